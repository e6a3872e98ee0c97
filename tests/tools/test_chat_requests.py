"""``prefixd.tools.chat_requests``' flags, the ones ``bench/e2e.py`` and ``bench/vllm.py`` share."""

import argparse

import pytest

from prefixd.tools.chat_requests import add_request_args, request_params

FULL = dict(systems=4, questions=8, system_tokens=1500, new_tokens=32, restart_at=6)
QUICK = dict(systems=2, questions=3, system_tokens=200, new_tokens=8, restart_at=2)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_request_args(parser, QUICK)
    parser.add_argument("--restart-at", type=int)
    return parser.parse_args(argv)


def test_no_flags_are_the_full_sizes():
    args = parse([])
    assert not args.json and not args.quick
    assert request_params(args, FULL, QUICK) == FULL


def test_quick_picks_the_quick_sizes_and_each_flag_set_overrides_one():
    args = parse(["--quick", "--json", "--system-tokens", "300", "--restart-at", "1"])
    assert args.json
    assert request_params(args, FULL, QUICK) == dict(QUICK, system_tokens=300, restart_at=1)
    assert request_params(parse(["--systems", "1", "--new-tokens", "2"]), FULL, QUICK) == \
        dict(FULL, systems=1, new_tokens=2)


def test_a_size_that_is_not_a_number_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--questions", "many"])
    assert "--questions: invalid int value" in capsys.readouterr().err
