"""How a cluster of GPUs is spelled, one way for :func:`jzero.gpu_mesh`, ``target=`` and
``--target``: ``"h100:8"`` (8 H100s on one host), ``"h100:64"`` (64, in hosts of 8, as
DGX/HGX nodes are), ``"h200:8x8"`` (8 hosts of 8), or a GPU's name with ``devices=`` and
``hosts=``."""

from __future__ import annotations

import re
from typing import NamedTuple

SPECS = {
    "a100": "a100.txtpb",  # A100-SXM4-80GB
    "b200": "b200.txtpb",
    "h100": "h100.txtpb",  # H100 SXM, 80 GB HBM3
    "h200": "h200.txtpb",
    "v100": "v100.txtpb",  # V100-SXM2-32GB
    "v100-16gb": "v100_16gb.txtpb",  # V100-SXM2-16GB, XLA's own v100 spec
}
"""The GPUs :func:`jzero.gpu_mesh` knows: name -> spec file in ``specs/``."""

ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "v100-32gb": "v100"}
"""Other names accepted for the GPUs of :data:`SPECS`."""

GPUS_PER_HOST = 8  # "h100:64": hosts of 8, as DGX/HGX nodes are

FORMS = (
    "'h100:8' (8 H100s on one host), 'h100:64' (64 in hosts of 8), 'h200:8x8' (HOSTSxGPUS: "
    "8 hosts of 8), or a name with devices= and hosts= (jzero.gpu_mesh('h200', devices=64, "
    "hosts=8))"
)
"""The spellings, as every error about one lists them."""

_SPELLING = re.compile(r"\s*([A-Za-z0-9-]+)\s*(?::\s*(\d+)\s*(?:x\s*(\d+))?)?\s*")


class Cluster(NamedTuple):
    """GPUs of one kind, over hosts that hold as many each."""

    gpu: str  # a key of SPECS
    hosts: int
    devices: int  # in all

    @property
    def name(self) -> str:
        """The cluster spelled HOSTSxGPUS, e.g. ``"h200:8x8"``."""
        return f"{self.gpu}:{self.hosts}x{self.devices // self.hosts}"


def gpu_names() -> tuple[str, ...]:
    """The GPU names :func:`jzero.gpu_mesh` accepts (besides the aliases in
    :data:`ALIASES`)."""
    return tuple(SPECS)


def parse_cluster(spelled: str, *, devices: int | None = None, hosts: int | None = None) -> Cluster:
    """The cluster ``spelled`` names (one of :data:`FORMS`), its count given there or by
    ``devices=`` / ``hosts=``, not both; 8 GPUs when neither says.

    Examples:
        >>> parse_cluster("h200:8x8")
        Cluster(gpu='h200', hosts=8, devices=64)
        >>> parse_cluster("h100", devices=16) == parse_cluster("h100:2x8")
        True
    """
    match = _SPELLING.fullmatch(spelled) if isinstance(spelled, str) else None
    if match is None:
        raise ValueError(
            f"GPUs {spelled!r} are not spelled as jzero knows: write {FORMS}. "
            f"GPUs: {', '.join(gpu_names())}."
        )
    name, first, second = match.groups()
    gpu = _gpu_name(name, spelled)
    if first is not None and (devices is not None or hosts is not None):
        raise ValueError(
            f"{spelled!r} already says how many GPUs; give the count once: {spelled!r} alone, "
            f"or {gpu!r} with devices= and hosts=."
        )
    if first is None:
        return _cluster(gpu, GPUS_PER_HOST if devices is None else devices, hosts)
    count = int(first) * (1 if second is None else int(second))
    if count < 1:
        raise ValueError(f"{spelled!r} has no GPUs; write {FORMS}.")
    return _cluster(gpu, count, None if second is None else int(first))


def _gpu_name(name: str, spelled: str) -> str:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SPECS:
        where = "" if name == spelled.strip() else f" in {spelled!r}"
        raise ValueError(
            f"unknown GPU {name!r}{where}: jzero.gpu_mesh knows "
            f"{', '.join(gpu_names())} (aliases: {', '.join(ALIASES)}), case-insensitive; "
            f"write {FORMS}."
        )
    return key


def _cluster(gpu: str, devices: int, hosts: int | None) -> Cluster:
    """``devices`` GPUs over ``hosts`` hosts; by default, one host up to
    :data:`GPUS_PER_HOST`, hosts of that many above."""
    for what, n in (("devices", devices), ("hosts", hosts)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{what} must be a positive int, got {n!r}; e.g. {what}=8.")
    if hosts is None and devices > GPUS_PER_HOST and devices % GPUS_PER_HOST:
        raise ValueError(
            f"{devices} GPUs do not split into hosts of {GPUS_PER_HOST}; say the hosts, e.g. "
            f"'{gpu}:{_hosts_hint(devices)}' (HOSTSxGPUS) or hosts= with devices=."
        )
    hosts = max(1, devices // GPUS_PER_HOST) if hosts is None else hosts
    if devices % hosts:
        raise ValueError(
            f"{devices} GPUs over {hosts} hosts: each host holds devices // hosts GPUs, so "
            f"hosts must divide devices; e.g. devices={hosts * max(1, devices // hosts)}."
        )
    return Cluster(gpu, hosts, devices)


def _hosts_hint(count: int) -> str:
    per = next(p for p in range(min(count, GPUS_PER_HOST), 0, -1) if count % p == 0)
    return f"{count // per}x{per}"
