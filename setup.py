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
"""verl-sat: Staleness-Adaptive Trust Region (SAT) policy losses and routing replay as verl plugins."""

from setuptools import find_packages, setup

# torch is installed first by `make install` from the local CPU build (torch==2.13.0); the range here
# only makes sure pip never replaces it with another build.
install_requires = [
    "verl==0.9.1",
    "torch>=2.6",
    "hydra-core>=1.3",
    "omegaconf>=2.3",
    "matplotlib>=3.7",  # curves.png of the embedded engine and the sweep plots
    "tensorboard>=2.14",  # TensorBoard events of the embedded engine
]

extras_require = {
    # GPU-cluster extras map onto verl's own extras; tests never need them.
    "sglang": ["verl[sglang]==0.9.1"],
    "vllm": ["verl[vllm]==0.9.1"],
    "megatron": ["verl[megatron]==0.9.1"],
    "gpu": ["verl[flash-attn-cu130torch211]==0.9.1"],
    # verl's v1 trainer on a CPU (`verl-sat e2e`): the parts of verl's `verl-core` extra its transfer queue and
    # servers import (the whole extra also pulls GPU-only packages)
    "e2e": ["TransferQueue>=0.1.10", "pyzmq", "msgspec", "cachetools", "uvicorn", "fastapi", "orjson"],
    "test": ["pytest>=8", "ruff>=0.6", "setuptools>=70.1"],  # setuptools: the wheel-content test builds a wheel
}

setup(
    name="verl-sat",
    version="0.1.0",
    description="Staleness-Adaptive Trust Region (SAT) and routing replay for asynchronous RL with verl",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # the top-level recipes/ folder is the Hydra config group, shipped as verl_sat.recipes (pkg://verl_sat.recipes)
    packages=[*find_packages(include=["verl_sat", "verl_sat.*"]), "verl_sat.recipes"],
    package_dir={"verl_sat.recipes": "recipes"},
    # upstream/templates: the test files the upstream patch series adds to verl
    package_data={"verl_sat.recipes": ["*/*.yaml", "*/*/*.yaml"], "verl_sat.upstream": ["templates/*.py"]},
    install_requires=install_requires,
    extras_require=extras_require,
    entry_points={
        # verl imports every entry point of this group inside `import verl` (driver and Ray workers).
        "verl.plugins": ["verl_sat = verl_sat.plugin"],
        "console_scripts": ["verl-sat = verl_sat.cli:main"],
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
    ],
)
