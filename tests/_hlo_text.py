"""Hand-written optimized-HLO text shared by the HLO reader tests."""

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
