"""The model as parts (issue 30): fusers and heads chosen by type, each with a config of its own.

- ``VLFuseConfig()`` is the default model that configs/easy_vqa.yaml spells out;
- :class:`vlfuse.parts.Registry` turns a config file's mapping into a part's config, and refuses
  what the part does not have, naming the option and listing the part's options;
- a fuser and a head must fit together (tokens or evidence), and a fuser that reads word embeddings
  needs a from-scratch text encoder of depth 0;
- the flat options of before (``fusion_depth``, ``readout``, ...) are refused saying where they went,
  and :func:`vlfuse.model_io.parts_of_flat` turns an old flat architecture into the same model as parts,
  weight name for weight name (checked against the saved models of tests/fixtures).
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from vlfuse import model_io
from vlfuse.analysis.data import read_config
from vlfuse.encoders import TextEncoderConfig, load_tokenizer
from vlfuse.errors import MOVED_OPTIONS
from vlfuse.fusers import FUSERS, CellStepsConfig, FusionStackConfig, MapProgramConfig
from vlfuse.heads import HEADS, BilinearConfig, ExistenceConfig, PooledConfig
from vlfuse.model import VLFuseConfig, VLFuseModel, processor_for
from vlfuse.parts import EVIDENCE, TOKENS, PartConfig, Registry

from conftest import REPO, reader_config, tiny_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCRATCH_TEXT = dict(width=32, num_heads=2, max_length=16)
"""A from-scratch text encoder of :func:`tiny_config`'s size (depth given by each test)."""


def options_of(config_class) -> list[str]:
    """A part's options, in declaration order: its config's fields but ``type``."""
    return [spec.name for spec in dataclasses.fields(config_class) if spec.name != "type"]


# ------------------------------------------------------------------------ the default model
def test_the_default_config_is_the_architecture_that_configs_easy_vqa_yaml_spells_out():
    architecture = read_config(REPO / "configs" / "easy_vqa.yaml")["model"]["architecture"]
    from_file = VLFuseConfig.from_dict(architecture)
    assert from_file.to_dict() == VLFuseConfig().to_dict()
    assert from_file == VLFuseConfig()
    assert architecture["fuser"]["type"] == "fusion_stack" and architecture["head"]["type"] == "bilinear"


def test_the_default_config_is_a_fusion_stack_read_out_by_the_bilinear_head():
    config = VLFuseConfig()
    assert isinstance(config.fuser, FusionStackConfig) and config.fuser == FusionStackConfig()
    assert isinstance(config.head, BilinearConfig) and config.head == BilinearConfig()
    assert (config.fuser.depth, config.fuser.heads, config.fusion_dim // config.fuser.heads) == (2, 16, 4)
    assert config.pruned_heads == {}


def test_the_default_config_is_the_model_the_format_2_fixture_trained():
    """tests/fixtures/format_v2/easy_vqa_default was trained with configs/easy_vqa.yaml before the parts."""
    meta = json.loads((FIXTURES / "format_v2" / "easy_vqa_default" / "model" / "config.json").read_text())
    assert VLFuseConfig.from_dict(model_io.parts_of_flat(meta["config"])).to_dict() == VLFuseConfig().to_dict()


def test_default_configs_do_not_share_their_parts():
    first, second = VLFuseConfig(), VLFuseConfig()
    first.pruned_heads["0"] = [1]
    assert first.fuser is not second.fuser and second.pruned_heads == {}


# ------------------------------------------------------------------- the registries and their errors
def test_the_registries_hold_every_part_by_its_type():
    assert {"fusion_stack": FusionStackConfig, "cell_steps": CellStepsConfig, "map_program": MapProgramConfig}.items() <= FUSERS.configs.items()
    assert {"pooled": PooledConfig, "bilinear": BilinearConfig, "existence": ExistenceConfig}.items() <= HEADS.configs.items()
    assert (FUSERS.kind, FUSERS.default, HEADS.kind, HEADS.default) == ("fuser", "fusion_stack", "head", "bilinear")


def test_a_mapping_becomes_the_config_of_its_type_and_to_dict_gives_it_back():
    config = FUSERS.parse({"type": "cell_steps", "heads": 8, "mlp": "gelu"})
    assert config == CellStepsConfig(heads=8, mlp="gelu")
    assert config.to_dict() == {"type": "cell_steps", "heads": 8, "find_heads": None, "find_diversity_weight": 0.0,
                                "mlp_ratio": 2.0, "mlp": "gelu", "output_gate": True, "dropout": 0.0}
    assert list(config.to_dict()) == ["type", *options_of(CellStepsConfig)]  # type first
    assert FUSERS.parse(config.to_dict()) == config
    assert FUSERS.parse(config) is config  # a config is taken as it is


def test_a_mapping_without_a_type_is_the_registrys_default():
    assert FUSERS.parse({"depth": 1}) == FusionStackConfig(depth=1)
    assert HEADS.parse({}) == BilinearConfig()
    assert VLFuseConfig(fuser={"heads": 8}).fuser == FusionStackConfig(heads=8)


def test_an_unknown_option_is_named_with_the_options_of_the_part():
    message = (
        "fuser: a fuser of type 'fusion_stack' has no option depht (its options: "
        + ", ".join(options_of(FusionStackConfig)) + ")"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FUSERS.parse({"type": "fusion_stack", "depht": 2})
    with pytest.raises(ValueError, match=re.escape("a fuser of type 'fusion_stack' has no option depht, layers (its options: depth, heads,")):
        VLFuseConfig(fuser={"depht": 2, "layers": 1})
    # an option of another part: the cell-steps fuser has no depth, the pooled head no products
    with pytest.raises(ValueError, match=re.escape("fuser: a fuser of type 'cell_steps' has no option depth (its options: heads, find_heads, find_diversity_weight, mlp_ratio, mlp, output_gate, dropout)")):
        VLFuseConfig(fuser={"type": "cell_steps", "depth": 2}, head={"type": "existence"})
    with pytest.raises(ValueError, match=re.escape("head: a head of type 'existence' has no option dropout (its options: none)")):
        HEADS.parse({"type": "existence", "dropout": 0.1})


@pytest.mark.parametrize(
    "fuser, message",
    [
        ({"depth": "2"}, "fuser.depth must be int, got '2'"),
        ({"depth": 2.0}, "fuser.depth must be int, got 2.0"),
        ({"depth": True}, "fuser.depth must be int, got True"),
        ({"depth": None}, "fuser.depth must be int, got None"),
        ({"mlp": "relu"}, "fuser.mlp must be one of ['gelu', 'swiglu'], got 'relu'"),
        ({"normalizer": "sparsemax"}, "fuser.normalizer must be one of ['softmax', 'leaky_relu'], got 'sparsemax'"),
        ({"gated": "yes"}, "fuser.gated must be bool, got 'yes'"),
        ({"mlp_ratio": "2"}, "fuser.mlp_ratio must be float, got '2'"),
        ({"type": "cell_steps", "heads": 16.5}, "fuser.heads must be int, got 16.5"),
    ],
)
def test_a_value_of_the_wrong_type_is_named(fuser, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        VLFuseConfig(fuser=fuser)  # the fuser is parsed first: the head does not matter


def test_a_whole_number_is_a_float_option():
    assert VLFuseConfig(fuser={"mlp_ratio": 4}).fuser.mlp_ratio == 4
    assert HEADS.parse({"type": "pooled", "dropout": 0}) == PooledConfig(dropout=0.0)
    with pytest.raises(ValueError, match=re.escape("head.dropout must be float, got '0.1'")):
        VLFuseConfig(head={"type": "pooled", "dropout": "0.1"})


def test_an_unknown_type_lists_the_registered_types():
    with pytest.raises(ValueError, match=re.escape(f"fuser.type must be one of {sorted(FUSERS.configs)}, got 'transformer'")):
        VLFuseConfig(fuser={"type": "transformer"})
    with pytest.raises(ValueError, match=re.escape(f"head.type must be one of {sorted(HEADS.configs)}, got 'pool'")):
        VLFuseConfig(head={"type": "pool"})  # the old readout's name
    with pytest.raises(ValueError, match=re.escape("fuser must be a mapping with a type and its options, got 'cell_steps'")):
        VLFuseConfig(fuser="cell_steps")


def test_errors_name_where_the_part_is():
    with pytest.raises(ValueError, match=re.escape("model.fuser.depth must be int")):
        FUSERS.parse({"depth": "1"}, "model.fuser")


def test_value_checks_of_a_part_name_its_option():
    with pytest.raises(ValueError, match="fuser.depth must be between 1 and 1024, got 0"):
        VLFuseConfig(fuser={"depth": 0})
    with pytest.raises(ValueError, match="fuser.diversity_weight must be >= 0, got -1"):
        VLFuseConfig(fuser={"diversity_weight": -1.0})
    with pytest.raises(ValueError, match=re.escape("FusionStackConfig has type 'fusion_stack', got type='cell_steps'")):
        FusionStackConfig(type="cell_steps")


def test_a_new_part_is_registered_by_its_type_once():
    registry = Registry("widget", default="plain")

    @registry.register
    @dataclasses.dataclass
    class PlainConfig(PartConfig):
        type: str = "plain"
        size: int = 1

    assert registry.parse({"size": 3}) == PlainConfig(size=3)
    with pytest.raises(ValueError, match=re.escape("a widget of type 'plain' is already registered (")):
        registry.register(PlainConfig)
    with pytest.raises(ValueError, match=re.escape("widget: a widget of type 'plain' has no option colour (its options: size)")):
        registry.parse({"colour": "red"})

    @dataclasses.dataclass
    class Untyped(PartConfig):
        size: int = 1

    with pytest.raises(TypeError, match="Untyped needs a first field `type: str"):
        registry.register(Untyped)


@pytest.mark.parametrize("fields", [dict(fuser=PooledConfig()), dict(head=MapProgramConfig())], ids=["head-as-fuser", "fuser-as-head"])
def test_a_config_of_another_kind_of_part_is_refused_naming_it(fields):
    kind = next(iter(fields))
    with pytest.raises(ValueError, match=rf"{kind} must be a {kind} config \(one of \[.*\]\), got {type(fields[kind]).__name__}"):
        VLFuseConfig(**fields)


def test_a_type_that_is_not_a_name_is_refused_naming_it():
    with pytest.raises(ValueError, match=re.escape("fuser.type must be one of")):
        VLFuseConfig(fuser={"type": ["cell_steps"]})


# --------------------------------------------------------------- a fuser and a head fit together
def test_what_each_part_gives_and_reads():
    assert (FusionStackConfig.gives, CellStepsConfig.gives, MapProgramConfig.gives) == (TOKENS, EVIDENCE, EVIDENCE)
    assert (PooledConfig.reads, BilinearConfig.reads, ExistenceConfig.reads) == (TOKENS, TOKENS, EVIDENCE)
    assert (FusionStackConfig.reads_words, CellStepsConfig.reads_words, MapProgramConfig.reads_words) == (False, True, True)


@pytest.mark.parametrize("fuser", ["map_program", "cell_steps"])
@pytest.mark.parametrize("head", ["pooled", "bilinear"])
def test_a_head_of_tokens_after_a_fuser_of_evidence_is_refused_naming_a_head_that_fits(fuser, head):
    text = TextEncoderConfig(depth=0, **SCRATCH_TEXT)
    message = f"head {head!r} reads tokens, but fuser {fuser!r} gives evidence: use a head of type 'existence'"
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(text=text, fuser={"type": fuser}, head={"type": head})


def test_the_existence_head_after_a_fusion_stack_is_refused_naming_the_heads_that_fit():
    with pytest.raises(ValueError, match="head 'existence' reads evidence, but fuser 'fusion_stack' gives tokens: use a head of type") as info:
        tiny_config(head={"type": "existence"})
    assert "'pooled'" in str(info.value) and "'bilinear'" in str(info.value)


@pytest.mark.parametrize("fuser", ["map_program", "cell_steps"])
def test_a_word_reading_fuser_refuses_a_from_scratch_text_encoder_with_layers(fuser):
    text = TextEncoderConfig(depth=1, **SCRATCH_TEXT)
    message = f"fuser {fuser!r} reads the question's word embeddings, not the encoder's layers: set text.depth to 0 for a from-scratch text encoder (got 1)"
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(text=text, fuser={"type": fuser}, head={"type": "existence"})
    config = tiny_config(text=TextEncoderConfig(depth=0, **SCRATCH_TEXT), fuser={"type": fuser}, head={"type": "existence"})
    assert config.fuser.type == fuser


def test_a_fusion_stack_reads_the_text_encoders_layers_at_any_depth():
    for depth in (0, 2):
        assert tiny_config(text=TextEncoderConfig(depth=depth, **SCRATCH_TEXT)).text.depth == depth


@pytest.mark.parametrize(
    "config",
    [VLFuseConfig(), tiny_config(), reader_config("map_program"), reader_config("cell_steps", heads=8, mlp="gelu"),
     tiny_config(fuser={"depth": 1, "normalizer": "leaky_relu"}, head={"type": "bilinear", "dropout": 0.1}, pruned_heads={"0": [1, 2]})],
    ids=["default", "tiny", "map_program", "cell_steps", "pruned"],
)
def test_to_dict_round_trips_through_from_dict(config):
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain data: what config.json holds
    again = VLFuseConfig.from_dict(data)
    assert again == config and again.to_dict() == data
    assert type(again.fuser) is type(config.fuser) and type(again.head) is type(config.head)


# ------------------------------------------------------------------ the flat options of before
@pytest.mark.parametrize("name", sorted(MOVED_OPTIONS))
def test_an_old_flat_option_is_refused_saying_which_part_has_it_now(name):
    data = {**VLFuseConfig().to_dict(), name: model_io.FORMAT_2_DEFAULTS[name]}
    message = f"unknown model config keys: [{name!r}] (options of the parts now: {name} -> {MOVED_OPTIONS[name]})"
    with pytest.raises(ValueError, match=re.escape(message)):
        VLFuseConfig.from_dict(data)


def test_fusion_depth_is_now_the_fusers_depth():
    with pytest.raises(ValueError, match=re.escape("fusion_depth -> fuser.depth")):
        VLFuseConfig.from_dict({"fusion_depth": 1})
    with pytest.raises(ValueError, match=re.escape("unknown model config keys: ['fusion_width']")) as info:
        VLFuseConfig.from_dict({"fusion_width": 1})
    assert "options of the parts" not in str(info.value)  # a key that never was an option gets no hint


def test_every_flat_option_that_left_the_config_says_where_it_went():
    gone = set(model_io.FORMAT_2_DEFAULTS) - set(VLFuseConfig.__dataclass_fields__)
    assert gone == set(MOVED_OPTIONS)
    for name, where in MOVED_OPTIONS.items():
        assert where.startswith(("fuser.", "head.")), name


OLD_FLAT = dict(
    fusion_dim=48, fusion_depth=3, fusion_heads=8, mlp_ratio=3.0, dropout=0.2, attn_dropout=0.1,
    text_self_attention=False, gated=False, attention_normalizer="leaky_relu", diversity_weight=0.5,
    output_gate=True, mlp_type="swiglu", pruned_heads={"1": [2]},
)
"""A flat architecture of format 2 with every fusion option away from its default then."""


@pytest.mark.parametrize("readout, head", [("pool", "pooled"), ("bilinear", "bilinear")])
def test_a_flat_fusion_model_becomes_a_fusion_stack_and_its_head(readout, head):
    parts = model_io.parts_of_flat({**OLD_FLAT, "readout": readout, "image": {"width": 32}, "text": {"width": 32}})
    assert parts == {
        "image": {"width": 32},
        "text": {"width": 32},
        "fusion_dim": 48,
        "pruned_heads": {"1": [2]},
        "fuser": {
            "type": "fusion_stack", "depth": 3, "heads": 8, "mlp_ratio": 3.0, "mlp": "swiglu", "output_gate": True,
            "self_attention": False, "gated": False, "normalizer": "leaky_relu", "dropout": 0.2, "attn_dropout": 0.1,
            "diversity_weight": 0.5,
        },
        "head": {"type": head, "dropout": 0.2},
    }
    VLFuseConfig.from_dict(parts)  # a valid config


def test_the_map_program_readout_becomes_its_fuser_and_the_existence_head():
    parts = model_io.parts_of_flat({"fusion_dim": 32, "fusion_depth": 0, "readout": "map_program", "output_gate": True})
    assert parts == {"fusion_dim": 32, "pruned_heads": {}, "fuser": {"type": "map_program"}, "head": {"type": "existence"}}


def test_the_cell_steps_readout_becomes_its_fuser_with_the_options_it_read_and_the_existence_head():
    parts = model_io.parts_of_flat({**OLD_FLAT, "fusion_depth": 0, "pruned_heads": {}, "readout": "cell_steps"})
    assert parts == {
        "fusion_dim": 48,
        "pruned_heads": {},
        "fuser": {"type": "cell_steps", "heads": 8, "mlp_ratio": 3.0, "mlp": "swiglu", "output_gate": True, "dropout": 0.2},
        "head": {"type": "existence"},
    }


def test_a_flat_field_a_file_lacks_takes_the_default_of_then():
    parts = model_io.parts_of_flat({})
    defaults = model_io.FORMAT_2_DEFAULTS
    assert parts["fusion_dim"] == defaults["fusion_dim"] and parts["head"] == {"type": "pooled", "dropout": defaults["dropout"]}
    assert parts["fuser"] == {
        "type": "fusion_stack", "depth": defaults["fusion_depth"], "heads": defaults["fusion_heads"],
        "mlp_ratio": defaults["mlp_ratio"], "mlp": defaults["mlp_type"], "output_gate": defaults["output_gate"],
        "self_attention": defaults["text_self_attention"], "gated": defaults["gated"],
        "normalizer": defaults["attention_normalizer"], "dropout": defaults["dropout"],
        "attn_dropout": defaults["attn_dropout"], "diversity_weight": defaults["diversity_weight"],
    }
    with pytest.raises(ValueError, match="readout 'max' of an earlier format is not one vlfuse knows"):
        model_io.parts_of_flat({"readout": "max"})


SAVED = {
    "format_v1/pool_swiglu_gate_pruned": "pool",
    "format_v1/pool_gelu_leaky_relu": "pool",
    "format_v1/shapes_map_program": "map_program",
    "format_v2/easy_vqa_default": "bilinear",
    "format_v2/shapes_fusion": "cell_steps",
}
"""The saved models of earlier formats in tests/fixtures, by the readout of their flat architecture."""


@pytest.mark.parametrize("name", sorted(SAVED))
def test_a_model_built_from_a_converted_flat_config_has_the_weights_of_the_old_one(name):
    """The names and shapes of the old file's weights, renamed to format 3, are exactly the new model's."""
    directory = FIXTURES / name / "model"
    meta = json.loads((directory / "config.json").read_text())
    assert meta["config"]["readout"] == SAVED[name]
    state = load_file(directory / "model.safetensors")
    if meta["format_version"] == 1:
        state = model_io.rename(state, model_io.FORMAT_1_KEYS.get(SAVED[name], {}))
    renamed = model_io.rename(state, model_io.format_3_keys(SAVED[name]))
    assert len(renamed) == len(state)  # no two names became one
    assert not any(key.startswith(("fusion.", "readout.")) for key in renamed)

    config = VLFuseConfig.from_dict(model_io.parts_of_flat(meta["config"]))
    text_hf = dict(meta["text_encoder_config"])
    text_hf_config = AutoConfig.for_model(text_hf.pop("model_type"), **text_hf)
    processor = processor_for(config, load_tokenizer(str(directory / "tokenizer")))
    answers = json.loads((directory / "answers.json").read_text())
    model = VLFuseModel(config, answers, processor, text_hf_config=text_hf_config, load_pretrained=False)
    built = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert sorted(built) == sorted(renamed)
    assert built == {key: tuple(value.shape) for key, value in renamed.items()}


def test_the_converted_parts_of_the_fixtures_are_the_parts_they_were():
    def parts(name: str) -> tuple:
        meta = json.loads((FIXTURES / name / "model" / "config.json").read_text())
        config = VLFuseConfig.from_dict(model_io.parts_of_flat(meta["config"]))
        return config.fuser, config.head, config.pruned_heads

    fuser, head, pruned = parts("format_v1/pool_swiglu_gate_pruned")
    assert (fuser.mlp, fuser.output_gate, fuser.self_attention, fuser.gated, head) == ("swiglu", True, True, True, PooledConfig())
    assert pruned == {"0": [1, 5, 9], "1": [0]}
    fuser, head, _ = parts("format_v1/pool_gelu_leaky_relu")
    assert (fuser.mlp, fuser.normalizer) == ("gelu", "leaky_relu")
    assert parts("format_v1/shapes_map_program")[:2] == (MapProgramConfig(), ExistenceConfig())
    assert parts("format_v2/shapes_fusion")[:2] == (CellStepsConfig(heads=16, mlp="swiglu", output_gate=True, dropout=0.0), ExistenceConfig())


def test_the_upgrade_of_a_saved_folder_is_parts_of_flat_and_the_renaming():
    directory = FIXTURES / "format_v2" / "easy_vqa_default" / "model"
    meta = json.loads((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    architecture, upgraded = model_io.upgrade_answering_model(2, meta["config"], state)
    assert architecture == model_io.parts_of_flat(meta["config"])
    assert upgraded.keys() == model_io.rename(state, {"fusion.": "fuser.stack.", "readout.": "head."}).keys()
    assert all(torch.equal(upgraded[key], value) for key, value in model_io.rename(state, model_io.format_3_keys("bilinear")).items())
    unchanged = model_io.upgrade_answering_model(3, architecture, upgraded)
    assert unchanged[0] is architecture and unchanged[1] is upgraded


def test_pruned_heads_of_a_config_are_layer_numbers():
    with pytest.raises(ValueError, match=r"pruned_heads maps layer numbers to head ids, got the keys \['x'\]"):
        tiny_config(pruned_heads={"x": [1]})
    assert tiny_config(pruned_heads={"1": [0, 2]}).pruned_heads == {"1": [0, 2]}
