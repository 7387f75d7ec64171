"""Every service reads its flags one way: flag over PAGEDSERVE_* variable over default."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.flags import EnvFlags, env_var


def parser_with(env: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    flags = EnvFlags(parser, env)
    flags.add("--max-num-seqs", int, "sequences", 256)
    flags.add_bool("--enable-prefix-caching", "prefix cache", True)
    return parser


def test_flag_wins_over_variable_which_wins_over_default():
    assert parser_with({}).parse_args([]).max_num_seqs == 256
    assert parser_with({"PAGEDSERVE_MAX_NUM_SEQS": "8"}).parse_args([]).max_num_seqs == 8
    args = parser_with({"PAGEDSERVE_MAX_NUM_SEQS": "8"}).parse_args(["--max-num-seqs", "3"])
    assert args.max_num_seqs == 3


def test_empty_variable_counts_as_unset():
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "", "PAGEDSERVE_ENABLE_PREFIX_CACHING": ""}
    args = parser_with(env).parse_args([])
    assert args.max_num_seqs == 256 and args.enable_prefix_caching is True


def test_boolean_variables_and_negated_flags():
    assert (
        parser_with({"PAGEDSERVE_ENABLE_PREFIX_CACHING": "off"}).parse_args([]).enable_prefix_caching is False
    )
    args = parser_with({}).parse_args(["--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False


def test_a_malformed_variable_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        parser_with({"PAGEDSERVE_MAX_NUM_SEQS": "many"})
    assert "PAGEDSERVE_MAX_NUM_SEQS" in capsys.readouterr().err


def test_variable_names_follow_the_flag():
    assert env_var("--kv-cache-memory") == "PAGEDSERVE_KV_CACHE_MEMORY"
