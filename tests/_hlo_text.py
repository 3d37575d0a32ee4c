"""HLO shared by the tests: hand-written module text, and a gather counter."""

import re

from jzero.accounting import collectives

ALL_REDUCE_MODULE = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%p), channel_id=1, GROUPS, to_apply=%add
}
"""
"""One all-reduce of f32[1024] on 8 partitions; replace ``GROUPS`` with its groups."""


def all_gathers(compiled, shape: tuple[int, ...]) -> int:
    """How many times per step the compiled program all-gathers an array of ``shape``
    (loop trip counts included)."""
    return sum(
        c.trip_count
        for c in collectives(compiled.as_text())
        if c.kind == "all-gather" and c.shape == shape
    )


def assert_gathered_per_layer(per_layer, whole, *, blocks, others, layers: int) -> None:
    """``per_layer`` (a compiled stage-3 step with ``layers=``) all-gathers each of the
    blocks' kernel shapes ``blocks`` once per layer in forward and again in backward, and
    each of ``others`` once; its temp memory is below ``whole``'s (no ``layers=``)."""
    for shape in blocks:
        assert all_gathers(per_layer, shape) == 2 * layers, shape
    for shape in others:
        assert all_gathers(per_layer, shape) == 1, shape
    temp = per_layer.memory_analysis().temp_size_in_bytes
    temp_whole = whole.memory_analysis().temp_size_in_bytes
    print(f"stage-3 temp: layers=Block {temp} B, without layers= {temp_whole} B")
    assert temp < temp_whole, (temp, temp_whole)


def loop_bodies(text: str) -> list[str]:
    """The text of each ``stablehlo.while`` body region (``do { ... }``) of lowered
    ``text``, with the bodies of the functions it calls appended (jax 0.11+ lowers a scan's
    body inline in the region; earlier releases called private functions from it)."""
    funcs = {f.split("(")[0].split("@")[-1].strip(): f for f in text.split("func.func")[1:]}
    out = []
    for start in (m.end() for m in re.finditer(r"\} do \{", text)):
        depth, end = 1, start
        while depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        body = text[start:end]
        called = set(re.findall(r"func.call @([\w.]+)\(", body))
        out.append(body + "".join(funcs[c] for c in sorted(called) if c in funcs))
    return out
