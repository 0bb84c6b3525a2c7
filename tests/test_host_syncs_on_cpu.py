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
"""Host syncs per loss call (forward + backward): the SAT losses may read the device at most twice more than verl's
``vanilla`` / ``gspo``, counted on CPU with ``verl_sat.host_sync.HostSyncCounter``."""

import pytest
import torch
from conftest import LOSS_CASES, QUANTILE_METHODS, actor_config, make_stale_batch, sat_overrides
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat.host_sync import HostSyncCounter

ALLOWED_ABOVE_VERL = 2
CASES = [(*case, method) for case in LOSS_CASES for method in QUANTILE_METHODS]


def _syncs(loss, config, batch, agg, mask=None) -> list[str]:
    lp = batch.fresh_log_prob()
    with HostSyncCounter() as syncs:
        pg_loss, _ = get_policy_loss_fn(loss)(
            batch.old_log_prob, lp, batch.advantages, batch.response_mask if mask is None else mask, agg, config
        )
        pg_loss.backward()
    return syncs.calls


def test_the_counter_sees_each_kind_of_read():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item(), float(x[0]), bool(x[1] > 0), x.tolist(), x[x > 2], x.nonzero(), x[torch.tensor(1)]
        torch.nonzero_static(x > 2, size=2), x[torch.tensor([1, 2])], torch.topk(x, 2)  # no reads
    assert syncs.calls == ["item", "__float__", "__bool__", "tolist", "__getitem__", "nonzero", "__getitem__"]


@pytest.mark.parametrize("loss,granularity,nominal,method", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("size", ["small", "radix"])  # the sort and the radix-select quantile paths
def test_sat_syncs_within_verls_plus_two(loss, granularity, nominal, method, agg, size):
    config = actor_config(*sat_overrides(loss, granularity,
                                         f"+actor_rollout_ref.actor.policy_loss.sat.quantile_method={method}"),
                          loss_mode=loss)  # fmt: skip
    batch = make_stale_batch(30) if size == "small" else make_stale_batch(30, num_prompts=64, group=8, length=40)
    verl_syncs = _syncs(nominal, config, batch, agg)
    sat_syncs = _syncs(loss, config, batch, agg)
    assert len(verl_syncs) == 3  # verl reads its three metrics one by one
    assert len(sat_syncs) <= len(verl_syncs) + ALLOWED_ABOVE_VERL, sat_syncs
    assert sat_syncs == ["tolist"]  # in fact once: every metric in one transfer
    # the same with nothing active
    assert _syncs(loss, config, batch, agg, torch.zeros_like(batch.response_mask)) == ["tolist"]
