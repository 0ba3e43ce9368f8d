"""The ``speculative_config`` section (``SpeculativeConfig`` in ``xengine/api/speculative_config.py``): validation
errors name the field, an unknown method is refused, any async scheduling mode goes with
speculation; and the ways in: ``xllm serve --speculative-config JSON`` through the real argparse parser,
the YAML section through ``xservice.config.load_config``, ``LLM(speculative_config={...})``'s config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xengine.api.config import EngineConfig, ExecutionConfig, SpeculativeConfig
from xengine.llm import engine_config
from xservice.cli import CliError, build_parser, load_cli_config, main
from xservice.commands.common import config_overrides
from xservice.config import load_config

NGRAM_3 = '{"method":"ngram","num_speculative_tokens":3}'


def test_off_by_default() -> None:
    cfg = SpeculativeConfig()
    assert not cfg.enabled
    cfg.validate()
    assert not EngineConfig().speculative_config.enabled


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "medusa"}, r"speculative_config\.method must be one of ngram, .*'medusa'"),
        ({"num_speculative_tokens": 0}, r"speculative_config\.num_speculative_tokens must be >= 1"),
        ({"num_speculative_tokens": -2}, r"speculative_config\.num_speculative_tokens must be >= 1"),
        ({"prompt_lookup_min": 0}, r"prompt_lookup_min <= prompt_lookup_max, got 0 and 4"),
        (
            {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_min <= prompt_lookup_max, got 3 and 2",
        ),
        ({"disable_by_batch_size": -1}, r"speculative_config\.disable_by_batch_size must be >= 0"),
    ],
)
def test_validation_errors_name_the_field(fields: dict, message: str) -> None:
    cfg = SpeculativeConfig(**{"method": "ngram", "num_speculative_tokens": 2, **fields})
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match=message):  # and through the engine's whole config
        EngineConfig(speculative_config=cfg).validate()


def test_fields_are_only_checked_when_a_method_is_set() -> None:
    SpeculativeConfig(num_speculative_tokens=0, prompt_lookup_min=0).validate()


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_methods_with_a_folder_of_their_own_need_it(method: str) -> None:
    SpeculativeConfig(method=method, num_speculative_tokens=2, model="/some/draft").validate()
    with pytest.raises(ValueError, match=rf"method {method} needs speculative_config\.model"):
        SpeculativeConfig(method=method, num_speculative_tokens=2).validate()


def test_an_unknown_method_is_refused() -> None:
    with pytest.raises(
        ValueError, match="must be one of ngram, draft_model, mtp, eagle, eagle3, got 'medusa'"
    ):
        SpeculativeConfig(method="medusa", num_speculative_tokens=2).validate()


def test_every_async_scheduling_mode_goes_with_speculation() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    for mode in ("on", "off", "auto"):
        EngineConfig(speculative_config=spec, execution=ExecutionConfig(async_scheduling=mode)).validate()


def test_serve_flag_sets_the_section() -> None:
    args = build_parser().parse_args(["serve", "--speculative-config", NGRAM_3])
    assert config_overrides(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    cfg = load_cli_config(args)
    assert cfg.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert cfg.engine.speculative_config == cfg.speculative_config  # what the engine is given
    assert "speculative_config" not in config_overrides(build_parser().parse_args(["serve"]))


def test_serve_help_documents_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--speculative-config JSON" in help_text and "'speculative_config'" in help_text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"ngram"', "must be a JSON object"),
    ],
)
def test_bad_json_is_an_argparse_error(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--speculative-config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method eagle needs speculative_config.model"),
        ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ],
)
def test_bad_values_in_the_flag_are_cli_errors(spec: dict, message: str) -> None:
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(spec)])
    with pytest.raises(CliError, match=message):
        load_cli_config(args)


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_yaml_section_loads(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n  prompt_lookup_max: 2\n"
        "  disable_by_batch_size: 8\n",
    )
    spec = load_config(path).speculative_config
    assert spec == SpeculativeConfig(
        method="ngram", num_speculative_tokens=5, prompt_lookup_max=2, disable_by_batch_size=8
    )


def test_flag_overrides_only_the_keys_it_gives(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n")
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--speculative-config", '{"num_speculative_tokens": 2}']
    )
    assert load_cli_config(args).speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "speculative_config:\n  method: ngram\n  lookahead: 2\n",
            "unknown config key 'speculative_config.lookahead'",
        ),
        (
            "speculative_config:\n  method: mtp\n  num_speculative_tokens: 0\n",
            "num_speculative_tokens must be >= 1",
        ),
    ],
)
def test_bad_yaml_section_is_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(write_yaml(tmp_path, text))


def test_llm_takes_the_dict_or_the_dataclass() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    as_dict = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    assert engine_config("/m", speculative_config=as_dict).speculative_config == spec
    assert engine_config("/m", speculative_config=spec).speculative_config == spec
    assert engine_config("/m").speculative_config == SpeculativeConfig()
    with pytest.raises(ValueError, match="unknown config key 'speculative_config.lookahead'"):
        engine_config("/m", speculative_config={"lookahead": 1})


@pytest.mark.parametrize(
    "field,value",
    [("num_speculative_tokens", 2.5), ("prompt_lookup_min", 1.5), ("prompt_lookup_max", "3"),
     ("disable_by_batch_size", True)],
)  # fmt: skip
def test_integer_fields_refuse_other_types_naming_the_field(field, value) -> None:
    cfg = SpeculativeConfig(**{"method": "ngram", "num_speculative_tokens": 2, field: value})
    with pytest.raises(ValueError, match=f"speculative_config.{field} must be an integer"):
        cfg.validate()
