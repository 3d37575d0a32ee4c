"""Accounting: the paper's formulas, what a compiled step holds and sends, and the report.

Public: the HLO collective reader (:func:`collectives`, :func:`comm_bytes`,
:class:`Collective`, :func:`summary_table`) and the theory formulas.
"""

from .estimate import theory_comm_bytes as theory_comm_bytes
from .estimate import theory_model_state_bytes as theory_model_state_bytes
from .hlo import Collective as Collective
from .hlo import collectives as collectives
from .hlo import comm_bytes as comm_bytes
from .hlo import summary_table as summary_table
