"""What a model's forward does to its LM head's output before the loss, read from its config and its forward.

A loss owner (the module whose forward takes ``labels``) may scale its logits (Cohere's and Aya Vision's
``logit_scale``, Granite's ``logits_scaling``) or softcap them (Gemma's ``final_logit_softcapping``) after the head;
a chunked loss that calls the head itself has to do the same. The rule depends on what transformers keeps stable,
not on class or function names: the CONFIG FIELD names (:data:`SCALES`, :data:`SOFTCAPS`) and where the owner's
forward code uses them (multiplying or dividing the logits, capping them). Which fields a forward uses differs
between releases (Aya Vision's ``logit_scale``: in its config on transformers 5.24, applied by its forward from
5.25), so it is read from the forward of the installed release; its value from the config (or the module attribute
the forward reads, as Cohere's ``self.logit_scale``). Proven per family against each sample alone through the stock
model (tests/test_logit_transforms.py). A use of such a field this rule cannot classify is refused.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

__all__ = ["SCALES", "SOFTCAPS", "LogitTransform", "logit_transform"]

SCALES = frozenset({"logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier"})
"""Config fields a forward multiplies or divides its logits by."""

SOFTCAPS = frozenset({"final_logit_softcapping", "logit_softcapping"})
"""Config fields a forward caps its logits with: ``tanh(logits / cap) * cap``."""


@dataclass(frozen=True)
class LogitTransform:
    """``logits * scale`` then ``tanh(logits / softcap) * softcap`` (None: not applied), as transformers' forwards
    order them."""

    scale: float | None = None
    softcap: float | None = None

    def as_kwargs(self) -> dict[str, float | None]:
        return {"scale": self.scale, "softcap": self.softcap}


def _name(node: ast.AST) -> str | None:
    """The field a node reads: ``self.config.text_config.X`` / ``self.X`` (an attribute) or a local ``X``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _value(owner: Any, field: str) -> Any:
    """The field's value: the owner's attribute of that name (the forward's ``self.X``), else its text config's,
    else its config's; None where none has it (the forward then reads it with a default and skips it: PaliGemma's
    Gemma 1 text config has no ``final_logit_softcapping``)."""
    if field in vars(owner) or isinstance(getattr(type(owner), field, None), property):
        return getattr(owner, field)
    config = owner.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (text, config):
        if hasattr(source, field):
            return getattr(source, field)
    return None


def logit_transform(owner: Any) -> LogitTransform:
    """What ``owner``'s forward does to its head's output (module docstring); ``ValueError`` naming the field when
    the forward uses a scale / softcap field other than as a factor, divisor or cap of a value."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
    ops: dict[str, set[str]] = {}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and _name(node) in SCALES | SOFTCAPS:
            used.add(_name(node))
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, (ast.Mult, ast.Div)):
            field = _name(node.right if isinstance(node, ast.BinOp) else node.value)
            if field in SCALES | SOFTCAPS:
                ops.setdefault(field, set()).add("*" if isinstance(node.op, ast.Mult) else "/")
    name = type(owner).__name__
    scale = softcap = None
    for field in sorted(used):
        found = ops.get(field, set())
        if field in SOFTCAPS:
            if found != {"*", "/"}:
                raise ValueError(f"{name}.forward uses {field!r} other than as tanh(logits / cap) * cap: vlm_pack's "
                                 "chunked loss cannot follow it; pass enable_packing(model, chunked_loss=False)")
            softcap = _value(owner, field)
            continue
        if len(found) != 1 or scale is not None:
            raise ValueError(f"{name}.forward uses {field!r} other than as one factor or divisor of its logits: "
                             "vlm_pack's chunked loss cannot follow it; pass enable_packing(model, chunked_loss=False)")
        value = _value(owner, field)
        if value is not None:
            scale = float(value) if found == {"*"} else 1.0 / float(value)
    return LogitTransform(scale, None if softcap is None else float(softcap))
