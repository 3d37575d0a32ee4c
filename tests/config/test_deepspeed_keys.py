"""Every key of a DeepSpeed config is named: unknown or unhonourable keys in one error
with why and the fix, the Hugging Face Trainer's ``"auto"`` values filled only when asked,
and the file read as DeepSpeed reads it (comments, duplicate keys)."""

import ast
import importlib
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _deepspeed import HF_AUTO, HF_ZERO2, OFFLOAD, deepspeed_lr, load, noted, problems, run_updates

import jzero
import jzero.config
from jzero.config import BatchSizes, DeepSpeedConfigWarning, jsonc

# ------------------------------------------------------------------ keys named


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation"),
        ({"zero_optimization": {"stage": 2, "foo": 1}}, "zero_optimization.foo"),
        (
            {"zero_optimization": {"offload_param": {"device": "none", "bar": 1}}},
            "zero_optimization.offload_param.bar",
        ),
        ({"fp16": {"enabled": True, "scale": 1}}, "fp16.scale"),
        ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}},
            "scheduler.params.warmup_steps",
        ),
    ],
)
def test_unknown_key_is_named_with_the_accepted_ones(config, path):
    with pytest.raises(
        ValueError, match=rf"unknown key '{re.escape(path)}'\. jzero accepts at .*: "
    ):
        load(config)


@pytest.mark.parametrize(
    ("config", "path"),
    [
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.device = 'nvme'",
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.device = 'nvme'",
        ),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale = 128.0"),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type = 'Lamb'"),
        ({"optimizer": {"type": "Adagrad"}}, "optimizer.type = 'Adagrad'"),
        ({"optimizer": {"type": "RMSprop"}}, "optimizer.type = 'RMSprop'"),
        ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm",
        ),
        ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, "optimizer.params.nesterov"),
        (
            {
                "optimizer": {"type": "Adam"},
                "scheduler": {
                    "type": "OneCycle",
                    "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1},
                },
            },
            "scheduler.params.cycle_momentum = True (absent: DeepSpeed's default)",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 9, "warmup_num_steps": 2},
                }
            },
            "scheduler.type",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
            "scheduler.params.last_batch_iteration",
        ),
        ({"scheduler": {"type": "WarmupDecayLR"}}, "scheduler.params.total_num_steps is required"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        ({"train_batch_size": "auto"}, "train_batch_size must be an integer, got 'auto'"),
        (
            {"gradient_accumulation_steps": 0},
            "gradient_accumulation_steps must be a positive integer",
        ),
    ],
)
def test_key_jzero_cannot_honour_is_named(config, path):
    with pytest.raises(ValueError, match=f"^DeepSpeed config: {re.escape(path)}"):
        load(config)


def test_fp16_master_weights_and_grads_says_to_remove_it_and_what_jzero_does():
    config = {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}
    assert str(problems(config)) == (
        "DeepSpeed config: fp16.fp16_master_weights_and_grads = True: jzero has no float16 "
        "master weights: for float16 parameters it keeps fp32 master weights in the "
        "optimizer's state (sharded over the devices from stage 1), updates them in fp32 and "
        "casts them down after each step. Remove the key, or set it to false, to train that "
        "way."
    )
    config["fp16"]["fp16_master_weights_and_grads"] = False  # what jzero does: accepted
    assert load(config).precision == load({"fp16": {"enabled": True}}).precision


OWN_TX = (
    'remove "optimizer" from the config and pass your own Optax transformation: '
    "options.optimizer(mesh, tx=...)."
)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"fp16": {"enabled": True, "loss_scale": 128}},
            "fp16.loss_scale = 128.0: jzero scales the loss dynamically (loss_scale 0) or not at "
            "all; a fixed scale is not implemented. Set it to 0 (or remove it) for dynamic "
            "scaling.",
        ),
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "fp16 = {'enabled': True}: fp16 and bf16 cannot both be enabled (DeepSpeed refuses "
            "it too); set fp16.enabled or bf16.enabled to false.",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
            "optimizer.params.bias_correction = False: Optax's Adam always corrects the bias; "
            "set it to true (or remove it).",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
            "optimizer.params.amsgrad = True: DeepSpeed's FusedAdam refuses it too; set it to "
            'false (or remove it), or remove "optimizer" from the config and pass the AMSGrad '
            "variant as your own Optax transformation: options.optimizer(mesh, "
            "tx=optax.amsgrad(...)).",
        ),
        (
            {"optimizer": {"type": "Lion", "params": {"max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm = 1.0: DeepSpeed refuses it too; remove it and set "
            'the top-level "gradient_clipping" instead.',
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"dampening": 0.1}}},
            "optimizer.params.dampening = 0.1: optax.sgd has no dampening; set it to 0 (or "
            "remove it).",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"nesterov": True}}},
            "optimizer.params.nesterov = True: it needs momentum > 0 (torch.optim.SGD refuses "
            "it too); set momentum above 0, or nesterov to false.",
        ),
        (
            {"optimizer": {"type": "OneBitAdam"}},
            "optimizer.type = 'OneBitAdam': 1-bit compressed communication is not in jzero (nor "
            f'in DeepSpeed\'s ZeRO); use type "Adam" (Adam with exact communication), or {OWN_TX}',
        ),
        (
            {"optimizer": {"type": "OneBitLamb"}},
            "optimizer.type = 'OneBitLamb': 1-bit compressed communication is not in jzero (nor "
            f"in DeepSpeed's ZeRO), and optax.lamb is not DeepSpeed's Lamb; {OWN_TX}",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
            "scheduler.params.last_batch_iteration = 5: jzero resumes a schedule from the update "
            "count in its checkpoint (jzero.Checkpointer); set last_batch_iteration to -1 (or "
            "remove it).",
        ),
        (
            {
                "optimizer": {"type": "Adam"},
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 5, "warmup_num_steps": 5},
                },
            },
            "scheduler.params.total_num_steps = 5: it must exceed warmup_num_steps (5); raise it "
            "above 5, or lower warmup_num_steps.",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 9, "warmup_num_steps": 2},
                }
            },
            "scheduler.type = 'WarmupCosineLR': WarmupCosineLR scales the optimizer's lr; add an "
            '"optimizer", or use a scheduler that sets the rate itself (WarmupLR, '
            "WarmupDecayLR, OneCycle, LRRangeTest).",
        ),
    ],
)
def test_a_refusal_says_what_to_do_instead(config, message):
    assert str(problems(config)) == f"DeepSpeed config: {message}"


# An instruction: an imperative verb opening a clause ("...; set it to false.").
WAY_OUT = re.compile(
    r"(?:^|[;:.(]\s*|,\s*or\s+)(?:remove|set|use|pass|add|keep|write|drop|raise|lower)\b",
    re.IGNORECASE,
)


def _refusal_texts(node, module):
    """The texts a refusal's ``why`` can be: a string; an f-string's fixed parts (with the
    module's string constants filled in); a module constant; every value of a module dict
    it indexes. None for ``rule.refused`` passed on (counted where the Key is written)."""
    if isinstance(node, ast.Attribute) and node.attr == "refused":
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                parts.append(part.value)
            elif isinstance(part.value, ast.Name) and isinstance(
                getattr(module, part.value.id, None), str
            ):
                parts.append(getattr(module, part.value.id))
            else:
                parts.append("{...}")
        return ["".join(parts)]
    if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
        return [getattr(module, node.id)]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return list(getattr(module, node.value.id).values())
    raise AssertionError(f"{module.__name__}: cannot read the refusal {ast.unparse(node)}")


def _refusals():
    """Every refusal text in jzero/config: each ``Key(refused=...)`` and each
    ``.refuse(key, why)`` call, by module."""
    found = {}
    for path in sorted(Path(jzero.config.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"jzero.config.{path.stem}")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            whys = [k.value for k in node.keywords if k.arg == "refused"]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "refuse":
                whys.append(node.args[1])
            for why in whys:
                found.setdefault(path.stem, []).extend(_refusal_texts(why, module))
    return found


def test_every_refusal_in_jzero_config_says_what_to_do():
    """Each text jzero/config refuses a key with says what to do instead: remove the key,
    set it to a value, or use or pass something else."""
    found = _refusals()
    counts = {stem: len(texts) for stem, texts in found.items() if texts}
    assert counts == {"deepspeed": 1, "fp16_bf16": 3, "optim": 14, "schedules": 4, "zero": 8}
    texts = [text for texts in found.values() for text in texts]
    assert [text for text in texts if not WAY_OUT.search(text)] == []


def test_keys_matching_jzero_pass_without_warning():
    """Values that say what jzero does anyway are honoured silently (warnings are errors)."""
    load(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "hysteresis": 1,
                "min_loss_scale": 1,
                "auto_cast": False,
            },
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "none"},
                "reduce_scatter": True,
            },
            "prescale_gradients": False,
        }
    )


def test_disabled_fp16_keys_are_warned_not_used():
    with pytest.warns(
        DeepSpeedConfigWarning, match=r"fp16\.initial_scale_power: fp16\.enabled is not true"
    ):
        ds = jzero.from_deepspeed_config({"fp16": {"enabled": False, "initial_scale_power": 8}})
    assert ds.precision == jzero.Precision()


def test_persistence_threshold_warned_below_stage_3():
    with pytest.warns(
        DeepSpeedConfigWarning,
        match="stage3_param_persistence_threshold: DeepSpeed uses it at stage 3 only",
    ):
        ds = jzero.from_deepspeed_config(
            {"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 10}}
        )
    assert ds.min_shard_size is None


# ------------------------------------------------------------------ every problem at once


def test_every_problem_is_named_in_one_error():
    error = problems(
        {
            "zero_optimisation": {"stage": 2},  # unknown
            "fp16": {"enabled": True, "loss_scale": 128},  # a fixed scale; and bf16 too
            "bf16": {"enabled": True},
            "gradient_clipping": -1,
            "train_batch_size": 0,
            "optimizer": {"type": "SGD", "params": {"nesterov": True}},  # without momentum
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_steps": 5}},
            "zero_optimization": {
                "stage": 0,
                "cpu_offload": True,  # at stage 0
                "offload_param": {"device": "nvme"},
            },
        }
    )
    assert error.keys == (
        "fp16",
        "fp16.loss_scale",
        "gradient_clipping",
        "optimizer.params.nesterov",
        "scheduler.params.total_num_steps",  # required
        "scheduler.params.warmup_steps",  # unknown
        "train_batch_size",
        "zero_optimisation",
        "zero_optimization.cpu_offload",
        "zero_optimization.offload_param.device",
    )
    assert error.auto == () and isinstance(error, ValueError)


def test_a_bad_value_does_not_bring_false_problems_with_it():
    """A key whose value is refused is not read further: the keys that depend on it are not
    blamed for it (the stage is unknown, so offload at 'stage 0' is not refused)."""
    error = problems(
        {
            "zero_optimization": {"stage": "2", "cpu_offload": True, "foo": 1},
            "optimizer": {"type": "Lamb", "params": {"lr": "auto"}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1}},
        }
    )
    # Lamb's params are not read (no table for them), nor is OneCycle's momentum refused
    # (whether a refused optimizer has betas is unknown).
    assert error.keys == ("optimizer.type", "zero_optimization.foo", "zero_optimization.stage")


def test_hf_trainer_zero2_config_names_its_13_auto_keys_at_once():
    error = problems(HF_ZERO2)
    assert error.keys == error.auto == HF_AUTO and len(HF_AUTO) == 13
    # The last line is the call that fills them all from Python.
    fill = str(error).splitlines()[-1]
    assert "jzero.from_deepspeed_config(config, auto={" in fill
    assert tuple(re.findall(r'"([\w.]+)": \.\.\.', fill)) == HF_AUTO


HF_VALUES = {  # what a Trainer would fill in: bf16, batch 8 x 2 steps x 8 devices
    "bf16.enabled": True,
    "fp16.enabled": False,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer.params.betas": [0.9, 0.95],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.lr": 3e-4,
    "optimizer.params.weight_decay": 0.1,
    "scheduler.params.warmup_max_lr": 3e-4,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_num_steps": 10,
    "train_batch_size": 128,
    "train_micro_batch_size_per_gpu": 8,
}


def written(config, values):
    """``config`` with each dotted path in ``values`` set, as if written in the file."""
    config = json.loads(json.dumps(config))
    for path, value in values.items():
        *parents, key = path.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        assert node[key] == "auto", path
        node[key] = value
    return config


def test_auto_fills_the_hf_config_as_if_written():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(HF_ZERO2, auto=HF_VALUES)
    # The optimizer's lr is replaced by WarmupLR's rates: warned, with the other keys.
    assert "optimizer.params.lr" in noted(record)
    config = json.loads(HF_ZERO2.read_text())
    with pytest.warns(DeepSpeedConfigWarning):
        assert jzero.from_deepspeed_config(config, auto=HF_VALUES)
    assert config == json.loads(HF_ZERO2.read_text())  # the caller's dict is left as it was
    with pytest.warns(DeepSpeedConfigWarning) as record_written:
        want = jzero.from_deepspeed_config(written(config, HF_VALUES))
    assert noted(record) == noted(record_written)
    same = ("stage", "precision", "offload", "gradient_clipping", "min_shard_size")
    assert [getattr(ds, f) for f in same] == [getattr(want, f) for f in same]
    assert (ds.stage, ds.offload, ds.precision) == (2, OFFLOAD, jzero.Precision(jnp.bfloat16))
    assert ds.batch_sizes(data_parallel_size=8) == BatchSizes(128, 8, 2)
    p = {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}
    got = [float(ds.learning_rate(jnp.int32(c))) for c in range(15)]
    want_lr = [deepspeed_lr("WarmupLR", p, None, c - 1) for c in range(15)]
    np.testing.assert_allclose(got, want_lr, rtol=1e-6)  # float32 against float64
    adamw = optax.adamw(ds.learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    want_params = run_updates(optax.chain(optax.clip_by_global_norm(1.0), adamw), steps=4)
    jax.tree.map(np.testing.assert_array_equal, run_updates(ds.tx, steps=4), want_params)


def test_auto_fills_only_auto_values():
    error = problems(
        HF_ZERO2,
        auto={
            **HF_VALUES,
            "zero_optimization.stage": 3,  # written 2 in the config: never replaced
            "optimizer.params.momentum": 0.9,  # not in the config
            "train_batch_size": "128",  # filled values are checked like written ones
        },
    )
    assert error.keys == (
        "optimizer.params.momentum",
        "train_batch_size",
        "zero_optimization.stage",
    )
    assert error.auto == ()
    for auto in ([("train_batch_size", 8)], {("train_batch_size",): 8}):
        with pytest.raises(TypeError, match="^auto= maps dotted key paths to values"):
            jzero.from_deepspeed_config(HF_ZERO2, auto=auto)


# ------------------------------------------------------------------ the file: keys, comments


def test_duplicate_keys_are_refused_at_every_level(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        """{
          "train_batch_size": 8,
          "zero_optimization": {
            "stage": 2, "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": true, "device": "none"}
          },
          "optimizer": {"type": "SGD", "params": {"lr": 0.1, "lr": 0.2, "lr": 0.3}},
          "train_batch_size": 16
        }"""
    )
    error = problems(path)
    assert error.keys == (
        "optimizer.params.lr",
        "train_batch_size",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.stage",
    )
    assert jsonc.parse(path.read_text())[1] == {
        "train_batch_size": [8, 16],
        "zero_optimization.stage": [2, 3],
        "zero_optimization.offload_optimizer.device": ["cpu", "none"],
        "optimizer.params.lr": [0.1, 0.2, 0.3],
    }


COMMENTED = """// DeepSpeed reads configs with hjson: these comments are allowed there.
{
  # the batch
  "train_micro_batch_size_per_gpu": 4,  // per device
  /* the optimizer,
     with "quotes" and // inside a block comment */
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3 /* peak */, "betas": [0.9, 0.95]}},
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "nvme_path": "/mnt/#1//nvme/*x*/"}  # a string
  }
}
"""


def test_comments_are_read_as_deepspeed_does(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(COMMENTED)
    assert jsonc.parse(COMMENTED) == (
        {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95]}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "nvme_path": "/mnt/#1//nvme/*x*/"},
            },
        },
        {},
    )
    with pytest.warns(DeepSpeedConfigWarning) as record:
        ds = jzero.from_deepspeed_config(path)
    assert noted(record) == ["zero_optimization.offload_optimizer.nvme_path"]
    assert (ds.stage, ds.offload, ds.micro_batch_size) == (2, OFFLOAD, 4)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (  # trailing comma: Python 3.13's json names the comma, 3.12's the "}" after it
            '{\n  /* a\n  comment */\n  "stage": 2,\n}',
            "line 4 column 13" if sys.version_info >= (3, 13) else "line 5 column 1",
        ),
        ('{\n  "optimizer": {"type": AdamW}\n}', "line 2 column 25"),  # a quoteless string
        ('{"stage": 2 /* never closed }', "line 1 column 13"),
    ],
)
def test_what_is_not_json_with_comments_is_refused_where_it_is(text, where, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(
        ValueError,
        match=f"^DeepSpeed config {re.escape(str(path))} is not valid JSON: .*: {where} ",
    ):
        jzero.from_deepspeed_config(path)
