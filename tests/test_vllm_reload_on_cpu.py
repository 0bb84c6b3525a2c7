# Copyright 2026 The verl-sat Authors
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""verl's weight updates into vLLM's CPU build, through verl-sat's worker extension (verl_sat/cpu/vllm_reload.py):
vLLM's float32 engine, updated through verl's own shared-memory transfer with what verl's FSDP engine sends, must
sample as the updated weights do. And the vLLM and verl code the extension works around, pinned: these tests fail
when that code changes, and the extension must then be revisited."""

import inspect
import sys

import pytest

from verl_sat.cpu import VLLM_EXTENSION


@pytest.fixture(scope="module")
def reload(vllm_float32):
    return vllm_float32["figures"]


def test_reloading_the_same_weights_changes_nothing(reload):
    assert reload["identical_tokens_same"] == 1.0
    assert reload["identical_max"] == 0.0


def test_vllm_samples_with_the_updated_weights(reload):
    # vLLM's CPU kernels against Transformers, both float32, on the moved weights
    assert reload["updated_max"] <= 1e-4
    assert reload["updated_routes_agree"] >= 0.99
    # a missed or garbled update would show the move itself (or, as vLLM's own reload does, nats)
    assert reload["updated_shift"] >= 100 * reload["updated_max"]


def test_the_extension_name_resolves_to_a_subclass_of_verls_extension():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    from verl_sat.cpu.vllm_reload import VLLMCPUWorkerExtension

    module, name = VLLM_EXTENSION.rsplit(".", 1)
    assert getattr(sys.modules[module], name) is VLLMCPUWorkerExtension
    assert issubclass(VLLMCPUWorkerExtension, vLLMColocateWorkerExtension)


def test_pin_vllm_cpu_linears_drop_their_weight():
    """vLLM hands a CPU linear's weight to a packed kernel and empties ``layer.weight``."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    source = inspect.getsource(UnquantizedLinearMethod.process_weights_after_loading)
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in source


def test_pin_vllm_prepacks_cpu_experts_on_the_first_load_only():
    """vLLM's unquantized MoE prepacks the CPU experts only while ``moe_kernel`` is unset."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    source = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)
    assert "is_weight_update = self.moe_kernel is not None" in source
    assert "if not is_weight_update:" in source
    assert "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in source


def test_pin_vllm_records_the_checkpoint_layout_at_model_init():
    """The extension restores layers from vLLM's record of their checkpoint layout, taken when the model is built."""
    from vllm.model_executor.model_loader import utils

    assert "record_metadata_for_reloading(model)" in inspect.getsource(utils.initialize_model)


def test_pin_verls_update_steps():
    """The extension runs verl's own steps for a plain full-weight update: receive buckets through
    ``BucketedWeightReceiver``, load each with ``_update_weights``, then vLLM's ``process_weights_after_loading``."""
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    source = inspect.getsource(vLLMColocateWorkerExtension.update_weights_from_ipc)
    for step in (
        "receiver = BucketedWeightReceiver(\n            zmq_handle=self._get_zmq_handle(),",
        "receiver.receive_weights(on_bucket_received=on_bucket_received)",
        "process_weights_after_loading(model, model_config, self.device)",
    ):
        assert step in source
    update = inspect.signature(vLLMColocateWorkerExtension._update_weights)
    assert list(update.parameters) == ["self", "weights", "peft_config", "base_sync_done"]
    # the method the extension overrides, as verl's ServerAdapter calls it (kwargs use_shm, peft_config, ...)
    received = inspect.signature(vLLMColocateWorkerExtension.update_weights_from_ipc)
    assert list(received.parameters) == ["self", "peft_config", "base_sync_done", "use_shm"]
