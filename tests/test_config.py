"""Config loading: release/golden files round-trip exactly, the YAML configs equal the presets, and every
unknown key, wrong type and impossible topology is rejected with the key (and file) named."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from dsv41_jax import config as C
from dsv41_jax.testing import GOLDEN, RELEASE

REPO = Path(__file__).resolve().parents[1]  # not from conftest: tests/*/conftest.py would shadow that name

RELEASE_CONFIG = RELEASE / "config.json"
TINY_HF_CONFIG = GOLDEN / "tiny_hf" / "config.json"
CONFIGS = REPO / "configs"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found (test data missing)")
    return path


def _load_config_file(path: Path) -> C.ModelConfig:
    """Later config files may wrap the model config in a top-level ``model:`` section."""
    data = yaml.safe_load(path.read_text()) or {}
    return C.load_yaml(path, section="model" if isinstance(data, dict) and "model" in data else None)


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _raises_naming(path: Path, *needles: str) -> str:
    """Load ``path``; it must raise ConfigError whose message names every needle and the file."""
    with pytest.raises(C.ConfigError) as info:
        C.load_yaml(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"
    return msg


# ----------------------------------------------------------------------------------------------------
# HF config.json: release and golden files


@pytest.mark.parametrize("path, preset", [(RELEASE_CONFIG, C.v41_flash), (TINY_HF_CONFIG, C.tiny)],
                         ids=["release", "tiny"])
def test_from_hf_equals_preset(path, preset):
    assert C.from_hf(_need(path)) == preset()
    assert C.from_hf(path.parent) == preset()  # a checkpoint directory works too
    assert C.from_hf(json.loads(path.read_text())) == preset()


@pytest.mark.parametrize("path, preset", [(RELEASE_CONFIG, C.v41_flash), (TINY_HF_CONFIG, C.tiny)],
                         ids=["release", "tiny"])
def test_to_hf_json_is_byte_identical(path, preset):
    assert C.to_hf_json(preset()).encode() == _need(path).read_bytes()


def test_release_config_hash_matches_spec():
    # spec model §1.1 pins the file by size and SHA-256; guards against a drifted copy
    data = _need(RELEASE_CONFIG).read_bytes()
    assert len(data) == 3311
    assert hashlib.sha256(data).hexdigest() == "8be45ce0476004a3f529fd896115a4a2e800a129ad2d3ec05b16050f52e21879"


def test_release_values_spot_check():
    # independent of the preset: numbers quoted in spec attention §1.1 / model §1.1
    cfg = C.from_hf(_need(RELEASE_CONFIG))
    a = cfg.attention
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.norm_eps) == (5120, 40, 129280, 1e-20)
    assert a.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert a.kv_source_layers == (2, 8, 14, 20)
    assert a.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (a.candidate_source_layer, a.candidate_topk_blocks, a.candidate_block_size) == (20, 2048, 8)
    assert (a.index_n_heads, a.index_head_dim, a.index_topk, a.window_size) == (32, 128, 512, 128)
    assert (a.rope_theta, a.compress_rope_theta, a.rope_factor, a.original_seq_len) == (1e4, 1.6e5, 16.0, 65536)
    assert (cfg.moe.n_routed_experts, cfg.moe.n_activated_experts, cfg.moe.moe_inter_dim) == (384, 6, 2304)
    assert cfg.engram.layer_ids == (1, 14) and cfg.engram.num_embeddings == (384006168, 384016682)
    assert cfg.dspark.target_layer_ids == (37, 38, 39)


def test_hf_unknown_text_config_key_rejected(tmp_path):
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    hf["text_config"]["num_hiden_layers"] = 40
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    with pytest.raises(C.ConfigError, match="num_hiden_layers") as info:
        C.from_hf(path)
    assert str(path) in str(info.value)
    with pytest.raises(C.ConfigError, match="num_hiden_layers"):
        C.from_hf(hf)


@pytest.mark.parametrize("where, key", [("top", "text_confg"), ("vision_config", "hiden_size")])
def test_hf_unknown_top_and_vision_keys_rejected(where, key):
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    (hf if where == "top" else hf[where])[key] = 1
    with pytest.raises(C.ConfigError, match=key):
        C.from_hf(hf)


@pytest.mark.parametrize("key, value", [("tie_word_embeddings", True), ("num_key_value_heads", 8)])
def test_hf_unsupported_architecture_rejected(key, value):
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    hf["text_config"][key] = value
    with pytest.raises(C.ConfigError, match=key):
        C.from_hf(hf)


def test_hf_rope_type_must_be_yarn():
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    hf["text_config"]["rope_scaling"]["rope_type"] = "linear"
    with pytest.raises(C.ConfigError, match="rope_type"):
        C.from_hf(hf)


def test_hf_inconsistent_layer_count_rejected():
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    hf["text_config"]["num_hidden_layers"] = 39
    with pytest.raises(C.ConfigError, match="compress_ratios"):
        C.from_hf(hf)


@pytest.mark.parametrize("edit", ["attention_bias", "hidden_act", "rope_scaling.mscale"])
def test_hf_unsupported_values_of_ignored_keys_rejected(edit):
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    text = hf["text_config"]
    if edit == "attention_bias":
        text["attention_bias"] = True
    elif edit == "hidden_act":
        text["hidden_act"] = "gelu"
    else:
        text["rope_scaling"]["mscale"] = 0.707
    with pytest.raises(C.ConfigError, match=edit.split(".")[-1]):
        C.from_hf(hf)


def test_hf_type_error_names_the_hf_key():
    hf = json.loads(_need(RELEASE_CONFIG).read_text())
    hf["text_config"]["hidden_size"] = "5120"
    with pytest.raises(C.ConfigError, match="hidden_size"):
        C.from_hf(hf)


# ----------------------------------------------------------------------------------------------------
# YAML configs shipped in configs/


def _config_files() -> list[Path]:
    return sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_configs_dir_has_the_model_configs():
    names = {p.name for p in _config_files()}
    assert {"tiny.yaml", "v41_flash.yaml"} <= names


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_file_parses(path):
    from dsv41_jax.train import dspark

    if dspark.is_dspark_config(path):  # a drafter-training run: its own sections, checked by its own loader
        assert isinstance(dspark.load_config(path), dspark.DSparkTrainConfig)
        return
    cfg = _load_config_file(path)
    assert isinstance(cfg, C.ModelConfig)


@pytest.mark.parametrize("name, preset", [("v41_flash.yaml", C.v41_flash), ("tiny.yaml", C.tiny)])
def test_yaml_config_equals_preset(name, preset):
    assert C.load_yaml(CONFIGS / name) == preset()


@pytest.mark.parametrize("name, preset", [("v41_flash.yaml", C.v41_flash), ("tiny.yaml", C.tiny)])
def test_yaml_config_spells_out_every_field(name, preset):
    # without `preset:` every value must still come from the file itself, on either base preset
    data = yaml.safe_load((CONFIGS / name).read_text())
    data.pop("preset", None)
    assert data == C.to_dict(preset())
    for base in C.PRESETS:
        assert C.from_dict({**data, "preset": base}) == preset()


def test_yaml_model_section(tmp_path):
    body = (CONFIGS / "tiny.yaml").read_text()
    nested = "model:\n" + "".join(f"  {line}\n" for line in body.splitlines()) + "train:\n  steps: 3\n"
    path = _write(tmp_path, nested)
    assert _load_config_file(path) == C.tiny()
    with pytest.raises(C.ConfigError, match="missing top-level key 'data'"):
        C.load_yaml(path, section="data")


def test_preset_alone_and_overrides(tmp_path):
    assert C.load_yaml(_write(tmp_path, "preset: tiny\n")) == C.tiny()
    assert C.load_yaml(_write(tmp_path, "{}\n")) == C.v41_flash()  # no keys: the release
    _raises_naming(_write(tmp_path, "# nothing yet\n"), "the file is empty")  # more likely a mistake
    cfg = C.load_yaml(_write(tmp_path, "preset: tiny\nattention: {window_size: 4}\n"))
    assert cfg.attention.window_size == 4 and cfg.attention.index_topk == 16  # only that key changed
    _raises_naming(_write(tmp_path, "preset: tinyy\n"), "tinyy")


@pytest.mark.parametrize("preset", [C.v41_flash, C.tiny])
def test_to_dict_from_dict_round_trip(preset, tmp_path):
    cfg = preset()
    d = C.to_dict(cfg)
    assert C.from_dict(d) == cfg
    assert C.from_dict(json.loads(json.dumps(d))) == cfg  # plain JSON types only
    path = _write(tmp_path, yaml.safe_dump(d))
    assert C.load_yaml(path) == cfg


# ----------------------------------------------------------------------------------------------------
# strictness: unknown keys and wrong types


@pytest.mark.parametrize("text, key", [
    ("windw_size: 3\n", "windw_size"),
    ("attention: {windw_size: 3}\n", "attention.windw_size"),
    ("moe:\n  n_experts: 8\n", "moe.n_experts"),
    ("engram: {layers: [1]}\n", "engram.layers"),
    ("vision: {depth: 2}\n", "vision.depth"),
])
def test_unknown_key_names_key_and_file(tmp_path, text, key):
    _raises_naming(_write(tmp_path, "preset: tiny\n" + text), key)


@pytest.mark.parametrize("text, key", [
    ("dim: '64'\n", "dim"),  # string for int
    ("dim: true\n", "dim"),  # bool for int
    ("dim: 64.0\n", "dim"),  # float for int, even an integral one
    ("dim: 64.5\n", "dim"),
    ("attention: {index_topk: '16'}\n", "attention.index_topk"),
    ("attention: {kv_source_layers: ['2', '4', '6']}\n", "attention.kv_source_layers"),  # list of strings
    ("attention: {kv_source_layers: 2}\n", "attention.kv_source_layers"),  # scalar for list
    ("attention: {compress_ratios: [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0.5]}\n", "attention.compress_ratios"),
    ("attention: {rope_theta: ten}\n", "attention.rope_theta"),  # string for float
    ("attention: {rope_theta: false}\n", "attention.rope_theta"),  # bool for float
    ("norm_eps: 1e\n", "norm_eps"),  # not a number: stays a string, refused for a float
    ("moe: {norm_topk_prob: 1}\n", "moe.norm_topk_prob"),  # int for bool
    ("moe: {score_func: 3}\n", "moe.score_func"),  # int for str
    ("attention: 5\n", "attention"),  # scalar for a sub-config
    ("engram: [1, 4]\n", "engram"),
])
def test_wrong_type_names_key(tmp_path, text, key):
    _raises_naming(_write(tmp_path, "preset: tiny\n" + text), key)


def test_wrong_type_without_file_names_key():
    with pytest.raises(C.ConfigError, match=re.escape("attention.kv_source_layers")):
        C.from_dict({"preset": "tiny", "attention": {"kv_source_layers": ["2", "4", "6"]}})


@pytest.mark.parametrize("text, value", [("1e-20", 1e-20), ("2E5", 2e5), ("+3e+2", 300.0), (".5e1", 5.0),
                                         ("1.0e-20", 1e-20), ("7e0", 7.0)])
def test_floats_without_a_point_are_numbers(tmp_path, text, value):
    # YAML 1.1 (PyYAML's safe_load) reads `1e-20` as the string '1e-20'; the config files read it as 1.2 does
    assert C.load_yaml(_write(tmp_path, f"preset: tiny\nnorm_eps: {text}\n")).norm_eps == value
    assert C.parse_value(text) == value and C.parse_value("-3e+2") == -300.0
    assert C.parse_value("1e") == "1e" and C.parse_value("e5") == "e5" and C.parse_value("1_000") == 1000


def test_float_accepts_int():
    cfg = C.from_dict({"preset": "tiny", "attention": {"rope_theta": 20000}})
    assert cfg.attention.rope_theta == 20000.0 and isinstance(cfg.attention.rope_theta, float)


@pytest.mark.parametrize("text, section", [("5\n", None), ("- a\n- b\n", None), ("model: 5\n", "model"),
                                           ("1: 2\n", None), ("preset: [tiny]\n", None)],
                         ids=["scalar", "list", "section-scalar", "int-key", "preset-list"])
def test_non_mapping_document_is_config_error(tmp_path, text, section):
    path = _write(tmp_path, text)
    with pytest.raises(C.ConfigError) as info:
        C.load_yaml(path, section=section)
    assert str(path) in str(info.value)


def test_unreadable_yaml_is_config_error(tmp_path):
    path = _write(tmp_path, "attention: {window_size: [\n")
    with pytest.raises(C.ConfigError, match=re.escape(str(path))):
        C.load_yaml(path)
    with pytest.raises(C.ConfigError, match="nope.yaml"):
        C.load_yaml(tmp_path / "nope.yaml")


# ----------------------------------------------------------------------------------------------------
# strictness: impossible topologies (on the tiny base: 12 layers, KV 2/4/6, index 2/4/6/8/10, cand 6)


@pytest.mark.parametrize("attention, keys", [
    # candidate pool 8·4 − 3 = 29 < 30 = top-k
    ("{index_topk: 30}", ["index_topk", "candidate"]),
    ("{candidate_topk_blocks: 4}", ["index_topk", "candidate"]),  # 4·4 − 3 = 13 < 16
    # a compressed layer (1) before the first KV source (2)
    ("{compress_ratios: [0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0]}", ["layer 1", "kv_source_layers"]),
    # a Reindex layer (2) before any KV source (4)
    ("{kv_source_layers: [4, 6], index_source_layers: [2, 4, 6, 8, 10]}", ["layer 2", "kv_source_layers"]),
    # Reuse layers (2, 3) before any KV source
    ("{kv_source_layers: [4, 6], index_source_layers: [4, 6, 8, 10]}", ["layer 2", "kv_source_layers"]),
    # a KV source that is pure SWA
    ("{kv_source_layers: [1, 2, 4, 6], index_source_layers: [1, 2, 4, 6, 8, 10]}", ["kv_source_layers", "SWA"]),
    ("{kv_source_layers: [0, 2, 4, 6], index_source_layers: [0, 2, 4, 6, 8, 10]}", ["kv_source_layers", "SWA"]),
    # an index source that is pure SWA
    ("{index_source_layers: [1, 2, 4, 6, 8, 10]}", ["index_source_layers", "SWA"]),
    # compress_ratios one short / one long of n_layers + DSpark stages
    ("{compress_ratios: [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0]}", ["compress_ratios"]),
    ("{compress_ratios: [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]}", ["compress_ratios"]),
    # a DSpark stage that compresses
    ("{compress_ratios: [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 1]}", ["compress_ratios"]),
    # candidate source not a KV source (8 is a Reindex layer; 7 a Reuse layer)
    ("{candidate_source_layer: 8}", ["candidate_source_layer"]),
    ("{candidate_source_layer: 7}", ["candidate_source_layer"]),
    # candidate source a KV source but not the last one
    ("{candidate_source_layer: 4}", ["candidate_source_layer"]),
    # o_groups must divide heads
    ("{o_groups: 3}", ["o_groups"]),
    # a layer reading a KV source of another ratio (layer 6 has ratio 1, its source 4 ratio 2)
    ("{kv_source_layers: [2, 4], index_source_layers: [2, 4, 8, 10], candidate_source_layer: 4}",
     ["kv_source_layers"]),
    # unsorted / out-of-range source lists
    ("{kv_source_layers: [4, 2, 6]}", ["kv_source_layers"]),
    ("{index_source_layers: [2, 4, 6, 8, 10, 12]}", ["index_source_layers"]),
    # a KV source must own index keys, i.e. be an index source too
    ("{index_source_layers: [2, 6, 8, 10]}", ["kv_source_layers"]),
])
def test_impossible_topology_names_key_and_file(tmp_path, attention, keys):
    _raises_naming(_write(tmp_path, f"preset: tiny\nattention: {attention}\n"), *keys)


def test_candidate_pool_boundary_is_allowed():
    # the pool may hold a single visible entry in its pinned newest block: 8·4 − 3 = 29 is enough for 29
    assert C.from_dict({"preset": "tiny", "attention": {"index_topk": 29}}).attention.index_topk == 29


def test_release_candidate_pool_covers_topk():
    a = C.v41_flash().attention
    assert a.candidate_pool_min == 2048 * 8 - 7 >= a.index_topk


@pytest.mark.parametrize("attention, key", [
    (dict(o_groups=3), "o_groups"),
    (dict(index_topk=30), "index_topk"),
    (dict(candidate_source_layer=8), "candidate_source_layer"),
])
def test_impossible_topology_in_python_construction(attention, key):
    # replacing a sub-config directly (no file) validates too
    base = C.tiny()
    with pytest.raises(C.ConfigError, match=key):
        base.replace(attention=dataclasses.replace(base.attention, **attention))


@pytest.mark.parametrize("text, key", [
    ("engram: {layer_ids: [1, 4, 5]}\n", "engram"),  # one num_embeddings entry per layer
    ("engram: {layer_ids: [1, 12]}\n", "engram.layer_ids"),  # not a backbone layer
    ("dspark: {target_layer_ids: [9, 10, 12]}\n", "dspark.target_layer_ids"),
    ("dspark: {target_layer_ids: [9, 11, 10]}\n", "layer order"),  # features are concatenated in layer order
    ("moe: {n_activated_experts: 9}\n", "n_activated_experts"),
    ("moe: {score_func: softmax}\n", "moe.score_func"),
    ("dtype: float16\n", "dtype"),
    ("attention: {kernel_backend: triton}\n", "attention.kernel_backend"),
    ("attention: {kernel_backend: 1}\n", "attention.kernel_backend"),
    ("mhc: {sinkhorn_unroll_rows: -1}\n", "mhc.sinkhorn_unroll_rows"),
])
def test_other_inconsistent_values_rejected(tmp_path, text, key):
    _raises_naming(_write(tmp_path, "preset: tiny\n" + text), key)


def test_kernel_backend_is_a_runtime_key(tmp_path):
    """``attention.kernel_backend`` loads from YAML and stays out of the HF config.json (not architecture)."""
    cfg = C.load_yaml(_write(tmp_path, "preset: tiny\nattention: {kernel_backend: pallas}\n"))
    assert cfg.attention.kernel_backend == "pallas" and C.tiny().attention.kernel_backend == "xla"
    assert C.to_hf_json(cfg) == C.to_hf_json(C.tiny())
    assert "kernel_backend" not in C.to_hf_json(cfg)
    assert C.from_hf(json.loads(C.to_hf_json(cfg))).attention.kernel_backend == "xla"
    cfg = C.load_yaml(_write(tmp_path, "preset: tiny\nmhc: {sinkhorn_unroll_rows: 0}\n"))  # the same for this one
    assert cfg.mhc.sinkhorn_unroll_rows == 0 and C.to_hf_json(cfg) == C.to_hf_json(C.tiny())


def test_configs_are_frozen():
    cfg = C.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 3  # type: ignore[misc]
    assert hash(cfg) == hash(copy.deepcopy(cfg))


# ----------------------------------------------------------------------------------------------------
# the strict-construction helpers the run configs (train, optim, posttrain) build on


@dataclasses.dataclass(frozen=True)
class _Section:
    lr: float = 1.0
    steps: int = 1
    sub: C.CacheQuant = dataclasses.field(default_factory=C.CacheQuant)


def test_build_dataclass_names_prefixed_key_and_file():
    base = _Section()
    built = C.build_dataclass(_Section, {"lr": 2, "sub": {"swa": False}}, base, "run.", "r.yaml")
    assert built == _Section(lr=2.0, sub=C.CacheQuant(swa=False)) and isinstance(built.lr, float)
    for data, key in [({"stpes": 3}, "run.stpes"), ({"steps": True}, "run.steps"), ({"sub": {"x": 1}}, "run.sub.x"),
                      ({"sub": 5}, "run.sub")]:
        with pytest.raises(C.ConfigError, match=rf"^r\.yaml: .*'?{re.escape(key)}"):
            C.build_dataclass(_Section, data, base, "run.", "r.yaml")


def test_fail_and_check_type():
    with pytest.raises(C.ConfigError, match=r"^f\.yaml: bad$"):
        C.fail("bad", "f.yaml")
    with pytest.raises(C.ConfigError, match=r"^bad$"):
        C.fail("bad")
    assert C.check_type([1, 2], tuple[int, ...], "k", None) == (1, 2)
    assert C.check_type(None, float | None, "k", None) is None
    with pytest.raises(C.ConfigError, match="key 'k' must be a number"):
        C.check_type(True, float, "k", None)
