"""DeepSpeed's ``"optimizer"`` as an Optax transformation with the same update rule.

``Adam``/``AdamW`` are DeepSpeed's FusedAdam: decoupled weight decay (AdamW) unless type
``Adam`` has ``"adam_w_mode": false`` (then L2: the decay is added to the gradient);
``"torch_adam": true`` picks torch.optim's, whose AdamW decays by 0.01 by default. ``SGD`` is
torch.optim.SGD and ``Lion`` DeepSpeed's FusedLion. Each is its Optax counterpart formula for
formula; DeepSpeed optimizers that Optax has no exact counterpart for are refused, with why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import optax

from .keys import REQUIRED, Key, Section, attempt, boolean, no_effect, number, pair, string

CLIPPING = Key(
    refused='DeepSpeed refuses it too; remove it and set the top-level "gradient_clipping" instead.'
)
GRAD_NONE = no_effect("jzero's gradients exist only inside the step")
ADAM = {
    "lr": Key(number, 0.001),
    "betas": Key(pair, (0.9, 0.999)),
    "eps": Key(number, 1e-8),
    "weight_decay": Key(number, 0.0),
    "adam_w_mode": Key(boolean, True),
    "torch_adam": Key(boolean, False),
    "bias_correction": Key(
        boolean,
        True,
        refused="Optax's Adam always corrects the bias; set it to true (or remove it).",
        matches=(True,),
    ),
    "amsgrad": Key(
        boolean,
        False,
        refused="DeepSpeed's FusedAdam refuses it too; set it to false (or remove it), or "
        'remove "optimizer" from the config and pass the AMSGrad variant as your own Optax '
        "transformation: options.optimizer(mesh, tx=optax.amsgrad(...)).",
        matches=(False,),
    ),
    "max_grad_norm": CLIPPING,
    "set_grad_none": GRAD_NONE,
}
SGD = {
    "lr": Key(number, 0.001),
    "momentum": Key(number, 0.0),
    "nesterov": Key(boolean, False),
    "weight_decay": Key(number, 0.0),
    "dampening": Key(
        number,
        0.0,
        refused="optax.sgd has no dampening; set it to 0 (or remove it).",
        matches=(0.0,),
    ),
    "max_grad_norm": CLIPPING,
}
LION = {
    "lr": Key(number, 0.001),
    "betas": Key(pair, (0.9, 0.999)),  # FusedLion's default, not optax.lion's (0.9, 0.99)
    "weight_decay": Key(number, 0.0),
    "max_grad_norm": CLIPPING,
    "set_grad_none": GRAD_NONE,
}
OWN_TX = (
    'remove "optimizer" from the config and pass your own Optax transformation: '
    "options.optimizer(mesh, tx=...)"
)
REFUSED = {
    "lamb": "DeepSpeed's FusedLamb clamps the trust ratio to [min_coeff, max_coeff] and "
    f"takes it before bias correction, optax.lamb does neither; {OWN_TX}.",
    "adagrad": f"torch's Adagrad adds eps outside the square root, optax.adagrad inside; {OWN_TX}.",
    "onebitadam": "1-bit compressed communication is not in jzero (nor in DeepSpeed's ZeRO); "
    f'use type "Adam" (Adam with exact communication), or {OWN_TX}.',
    "onebitlamb": "1-bit compressed communication is not in jzero (nor in DeepSpeed's ZeRO), "
    f"and optax.lamb is not DeepSpeed's Lamb; {OWN_TX}.",
    "zerooneadam": "0/1 Adam's compressed communication is not in jzero (nor in DeepSpeed's "
    f'ZeRO); use type "Adam" (Adam with exact communication), or {OWN_TX}.',
    "muadam": f"muP needs per-parameter learning rates (optax.multi_transform); {OWN_TX}.",
    "muadamw": f"muP needs per-parameter learning rates (optax.multi_transform); {OWN_TX}.",
    "musgd": f"muP needs per-parameter learning rates (optax.multi_transform); {OWN_TX}.",
}


def with_decay(weight_decay: float, tx: optax.GradientTransformation):
    """L2 weight decay as torch applies it: ``weight_decay * param`` added to the gradient."""
    return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx


def adam(p: Section, lr: optax.ScalarOrSchedule, *, adamw: bool) -> optax.GradientTransformation:
    decoupled = adamw or p["adam_w_mode"]
    torch_default = 0.01 if decoupled and p["torch_adam"] else 0.0  # torch.optim.AdamW's
    decay = p.get("weight_decay", torch_default)
    (b1, b2), eps = p["betas"], p["eps"]
    if decoupled:
        return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=decay)
    return with_decay(decay, optax.adam(lr, b1=b1, b2=b2, eps=eps))


def sgd(p: Section, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    tx = optax.sgd(lr, momentum=p["momentum"] or None, nesterov=p["nesterov"])
    return with_decay(p["weight_decay"], tx)


def lion(p: Section, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    (b1, b2), decay = p["betas"], p["weight_decay"]
    return optax.lion(lr, b1=b1, b2=b2, weight_decay=decay)


def check_params(kind: str, p: Section) -> None:
    """What the params of optimizer ``kind`` cannot say, refused or noted while reading (the
    builders above run only once the whole config is read without a problem)."""
    if kind == "adamw" and "adam_w_mode" in p and not p["adam_w_mode"]:
        p.note("adam_w_mode", 'type "AdamW" always decouples weight decay, as in DeepSpeed')
    if kind == "sgd" and p["nesterov"] and p["momentum"] <= 0:
        p.refuse(
            "nesterov",
            "it needs momentum > 0 (torch.optim.SGD refuses it too); set momentum above 0, or "
            "nesterov to false.",
        )


# lower-case type (DeepSpeed compares them so) -> (its params' table, the builder).
OPTIMIZERS: dict[str, tuple[dict[str, Key], Callable[..., optax.GradientTransformation]]] = {
    "adam": (ADAM, functools.partial(adam, adamw=False)),
    "adamw": (ADAM, functools.partial(adam, adamw=True)),
    "sgd": (SGD, sgd),
    "lion": (LION, lion),
}
OPTIMIZER = {
    "type": Key(string, REQUIRED),
    "params": Key(default={}),
    "legacy_fusion": no_effect("XLA fuses the update"),
}


class Optimizer(NamedTuple):
    """The config's optimizer, read: its lr and betas are what a scheduler needs. A field is
    None where the config's problem (listed in the error) left it unknown."""

    params: Section | None  # "optimizer.params", checked
    build: Callable[..., optax.GradientTransformation] | None  # (params, learning rate) -> tx
    lr: float | None  # params.lr, or the optimizer's default
    betas: bool | None  # whether it has betas (OneCycle would cycle beta1)

    def tx(self, learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
        return self.build(self.params, learning_rate)


UNKNOWN = Optimizer(None, None, None, None)  # an "optimizer" whose type has a problem


def read_optimizer(top: Section) -> Optimizer | None:
    """Checks the config's ``"optimizer"`` and its params; None when the config has none."""
    if "optimizer" not in top:
        return None
    return attempt(_read, top) or UNKNOWN


def _read(top: Section) -> Optimizer:
    section = top.section("optimizer", OPTIMIZER)
    kind = section["type"].lower()
    if kind in REFUSED:
        section.refuse("type", REFUSED[kind])
        return UNKNOWN
    if kind not in OPTIMIZERS:
        accepted = ", ".join(f'"{k}"' for k in OPTIMIZERS)
        section.refuse("type", f"jzero maps {accepted} (any case); {OWN_TX}.")
        return UNKNOWN
    table, build = OPTIMIZERS[kind]
    params = section.section("params", table)
    attempt(check_params, kind, params)
    return Optimizer(params, build, attempt(params.__getitem__, "lr"), "betas" in table)
