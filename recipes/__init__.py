# Copyright 2026 The verl-sat Authors
# Licensed under the Apache License, Version 2.0 (see LICENSE).
"""Hydra recipe group of verl-sat, installed as ``verl_sat.recipes`` (search path ``pkg://verl_sat.recipes``)."""
