"""Accounting: the paper's formulas, what a compiled step holds and sends, and the report.

Public: the HLO collective reader (:func:`collectives`, :func:`comm_bytes`,
:class:`Collective`, :func:`mesh_axes`, :func:`summary_table`, :func:`dot_flops`,
:func:`launches`) and the
theory formulas (per axis on a hybrid mesh; with hpZ, across and within its groups:
:data:`ACROSS`, :data:`WITHIN`).
"""

from .estimate import ACROSS as ACROSS
from .estimate import WITHIN as WITHIN
from .estimate import theory_comm_bytes as theory_comm_bytes
from .estimate import theory_comm_bytes_hpz as theory_comm_bytes_hpz
from .estimate import theory_comm_bytes_per_axis as theory_comm_bytes_per_axis
from .estimate import theory_model_state_bytes as theory_model_state_bytes
from .hlo import Collective as Collective
from .hlo import collectives as collectives
from .hlo import comm_bytes as comm_bytes
from .hlo import dot_flops as dot_flops
from .hlo import launches as launches
from .hlo import mesh_axes as mesh_axes
from .hlo import summary_table as summary_table
