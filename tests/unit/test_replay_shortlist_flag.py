"""The offline replay's ``--shortlist-above``: the routing core's candidate shortlist set as
the live gateway's ``policy.shortlist_above`` sets it (the replay copies the router)."""

from __future__ import annotations

import argparse

from loadtests.replay.prompts import PromptBuilder
from loadtests.replay.run import ReplayConfig, add_common_args, config_from_args
from loadtests.replay.sim import Simulation
from loadtests.replay.workers import make_workers
from policies.registry import create_policy


def _config(*flags: str) -> ReplayConfig:
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    return config_from_args(parser.parse_args(["--workload", "multi-turn", *flags]), 1.0)


def test_the_flag_reaches_the_config_with_the_live_default() -> None:
    assert _config().shortlist_above == 64
    assert _config("--shortlist-above", "0").shortlist_above == 0


def test_the_simulation_sets_the_cores_shortlist() -> None:
    sim = Simulation(create_policy("cache_aware"), make_workers(2, 10_000, None), 10_000,
                     PromptBuilder().prepare, shortlist_above=3)  # fmt: skip
    assert sim.core.shortlist.above == 3
