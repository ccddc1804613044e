"""One source of truth for config defaults: the schema (rlrunner/schema.py).

configs/grpo.yaml only selects the schema, and the configuration tables (the README's, docs/configuration.md's)
must show the schema's values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from rlrunner.checkpoint.policy import flatten
from rlrunner.config import load_config
from rlrunner.errors import ConfigError
from rlrunner.schema import GRPOConfig

_MISSING = "<absent>"
# A default cell part that is one plain literal: null, true, 16, 3e-4, {}, grpo-arith, ${a.b}/${c}.
_LITERAL = re.compile(r"^(\{\}|\[\]|[A-Za-z0-9_.+\-/${}]+)$")


def schema_tree(resolve: bool) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(GRPOConfig), resolve=resolve)


def lookup(tree: dict[str, Any], key: str) -> Any:
    """tree["a"]["b"] for "a.b" (an empty dict is a value too, unlike in `flatten`), or _MISSING."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def test_the_default_yaml_composes_to_exactly_the_schema_defaults():
    composed = flatten("", OmegaConf.to_container(load_config(), resolve=True))
    schema = flatten("", schema_tree(resolve=True))
    differences = sorted(k for k in set(schema) | set(composed) if schema.get(k, _MISSING) != composed.get(k, _MISSING))
    assert differences == [], [(k, schema.get(k, _MISSING), composed.get(k, _MISSING)) for k in differences]
    # The default job (tests/test_cli.py relies on group size 16; micro-batches by tokens, a rank's share in one).
    assert (
        schema["runner.max_steps"],
        schema["algorithm.group_size"],
        schema["actor.micro_batch_size"],
        schema["actor.micro_batch_tokens"],
    ) == (800, 16, None, 16384)
    assert (schema["actor.optim.lr"], schema["rollout.max_new_tokens"], schema["data.synthetic.max_operand"]) == (
        3e-4,
        4,
        4,
    )


def test_the_default_yaml_repeats_no_values(repo_root: Path):
    content = yaml.safe_load((repo_root / "configs" / "grpo.yaml").read_text())
    assert content == {"defaults": ["grpo_schema", "_self_"]}


def _table_rows(text: str, heading: str) -> list[tuple[str, str]]:
    """(key cell, default cell) of every row of the table under the `## <heading>` section of a markdown page."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows.append((cells[0], cells[1]))
    return rows


def _keys(cell: str) -> list[str]:
    """Full keys of a key cell: `.max_restarts` and `clip_ratio_high` are siblings of the key before them."""
    keys: list[str] = []
    for name in re.findall(r"`([^`]+)`", cell):
        if "." in name.lstrip(".") and not name.startswith("."):
            keys.append(name)
        else:
            keys.append(keys[-1].rsplit(".", 1)[0] + "." + name.lstrip("."))
    return keys


def _literals(cell: str) -> list[Any] | None:
    """The comma-separated defaults of a cell as values, or None when a part is not a plain literal."""
    parts = [part.strip().strip("`") for part in cell.split(",")]
    if not all(_LITERAL.match(part) for part in parts):
        return None
    return [_literal(part) for part in parts]


def _literal(text: str) -> Any:
    # Not yaml.safe_load: YAML 1.1 reads 3e-4 as a string.
    words = {"null": None, "true": True, "false": False, "{}": {}, "[]": []}
    if text in words:
        return words[text]
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def _same(documented: Any, actual: Any) -> bool:
    if isinstance(documented, bool) or isinstance(actual, bool):  # true must not pass for 1
        return documented is actual
    if isinstance(documented, (int, float)) and isinstance(actual, (int, float)):
        return float(documented) == float(actual)
    return documented == actual


@pytest.mark.parametrize(
    "page, heading, at_least", [("README.md", "Configuration", 10), ("docs/configuration.md", "Every key", 60)]
)
def test_the_configuration_tables_show_the_schema_defaults(repo_root: Path, page: str, heading: str, at_least: int):
    """The README's table of the keys people change and the docs' table of every key name real keys and their
    defaults."""
    schema = schema_tree(resolve=False)  # log_path is documented as its interpolation
    checked, wrong = [], []
    for key_cell, default_cell in _table_rows((repo_root / page).read_text(), heading):
        keys = _keys(key_cell)
        assert all(lookup(schema, key) is not _MISSING for key in keys), (
            f"{page} names a key the schema lacks: {key_cell}"
        )
        values = _literals(default_cell)
        if values is None:
            continue  # e.g. "0.2 (null = same)": prose, not a literal
        assert len(values) in (1, len(keys)), (
            f"{page}: a row has {len(keys)} keys and {len(values)} defaults: {key_cell}"
        )
        for key, value in zip(keys, values * len(keys) if len(values) == 1 else values):
            checked.append(key)
            if not _same(value, lookup(schema, key)):
                wrong.append(f"{key}: {page} {value!r}, schema {lookup(schema, key)!r}")
    assert wrong == []
    assert len(set(checked)) >= at_least, sorted(checked)


def test_checking_a_config_imports_no_torch(repo_root: Path):
    """The registries keep each backend's and engine's heavy parts lazy: `--cfg` and the driver's checks load no
    torch."""
    import subprocess
    import sys

    code = (
        "import sys; from rlrunner.config import load_config; load_config(); "
        "print(sorted(m for m in sys.modules if m == 'torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_config_file_with_a_moved_key_is_refused_with_its_new_name(tmp_path: Path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - grpo_schema\n  - _self_\nactor:\n  shard_weights: false\n")
    with pytest.raises(ConfigError, match=r"^config key 'actor.shard_weights' is now 'actor.megatron.shard_weights'"):
        load_config(config_name="mine", config_dir=tmp_path)
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - grpo_schema\n  - _self_\nactor:\n  megatron:\n    shard_weights: false\n"
    )
    assert load_config(["actor.training_backend=megatron"], config_name="mine", config_dir=tmp_path).actor.megatron == {
        "shard_gradients": True,
        "shard_weights": False,
        "ckpt_format": "torch",
        "overlap_grad_reduce": False,
        "ddp_bucket_size": None,
    }


def test_an_unknown_megatron_checkpoint_format_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^actor.megatron.ckpt_format must be one of torch, torch_dist, got 'dcp'$"):
        load_config(["actor.training_backend=megatron", "actor.megatron.ckpt_format=dcp"])
    assert load_config(["actor.megatron.ckpt_format=torch_dist"]).actor.megatron.ckpt_format == "torch_dist"
    with pytest.raises(ConfigError, match=r"^actor.megatron.ddp_bucket_size must be a positive number of elements or"):
        load_config(["actor.training_backend=megatron", "actor.megatron.ddp_bucket_size=0"])


def test_packing_by_prompt_needs_a_mask_the_attention_takes() -> None:
    with pytest.raises(ConfigError, match=r"^actor.pack_shared_prompts=true needs model.attn_implementation in sdpa "):
        load_config(["actor.pack_shared_prompts=true", "model.attn_implementation=eager"])
    # megatron's model always takes the mask; null with eager packs nothing (the worker's rule)
    assert load_config(
        ["actor.pack_shared_prompts=true", "model.attn_implementation=eager", "actor.training_backend=megatron"]
    ).actor.pack_shared_prompts
    assert load_config(["model.attn_implementation=eager"]).actor.pack_shared_prompts is None
