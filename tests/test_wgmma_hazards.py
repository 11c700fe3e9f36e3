"""tools/wgmma_hazards.py reads SASS right: a write to a register that a wgmma group still in
flight reads as its A operand is reported, and nothing else is (synthetic SASS, no compile)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("wgmma_hazards", ROOT / "tools" / "wgmma_hazards.py")
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _loop(*body: str) -> list[str]:
    """A loop body as ``main_loop`` returns it: one instruction a line."""
    return list(body)


TWO_GROUPS = (
    "WARPGROUP.ARRIVE",
    "HGMMA.64x64x16.F32 R56, R88, gdesc[UR8].tnspB, R56",
    "HGMMA.64x64x16.F32 R24, R92, gdesc[UR8].tnspB, R24, gsb0",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x64x16.F32 R56, R96, gdesc[UR8].tnspB, R56, gsb0",
)


def test_a_write_to_an_in_flight_operand_is_reported_across_the_loop_edge():
    # The loop ends with both groups allowed in flight; its top rewrites R89 (first group's).
    loop = _loop(
        "LOP3.LUT R89, R19, 0x800080, RZ, 0xc0, !PT", *TWO_GROUPS, "WARPGROUP.DEPBAR.LE gsb0, 0x2"
    )
    assert tool.hazards(loop) == ["LOP3.LUT R89, R19, 0x800080, RZ, 0xc0, !PT"]


def test_a_wait_that_retires_the_group_clears_the_write():
    loop = _loop(
        "LOP3.LUT R89, R19, 0x800080, RZ, 0xc0, !PT", *TWO_GROUPS, "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    )
    assert tool.hazards(loop) == []
    # Retiring only the older group clears R88-R95 but not the newer group's R96-R99.
    loop = _loop(
        "IMAD R97, R1, 0x2, R2",
        "IMAD R90, R1, 0x2, R2",
        *TWO_GROUPS,
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    )
    assert tool.hazards(loop) == ["IMAD R97, R1, 0x2, R2"]


def test_wide_and_predicated_writes_count_stores_and_registers_outside_do_not():
    tail = (*TWO_GROUPS, "WARPGROUP.DEPBAR.LE gsb0, 0x2")
    assert tool.hazards(_loop("LDS.64 R87, [R23+0x10000]", *tail)) == ["LDS.64 R87, [R23+0x10000]"]
    assert tool.hazards(_loop("LDS.128 R85, [R23]", *tail)) == ["LDS.128 R85, [R23]"]
    assert tool.hazards(_loop("LDS.128 R84, [R23]", *tail)) == []  # R84-R87: outside
    assert tool.hazards(_loop("@!P1 IMAD R99, R1, 0x2, R2", *tail)) == [
        "@!P1 IMAD R99, R1, 0x2, R2"
    ]
    assert (
        tool.hazards(
            _loop("STS [R88+UR5], R95", "LDS.64 R86, [R23]", "IMAD R100, R1, 2, R2", *tail)
        )
        == []
    )


def test_the_main_loop_is_the_backward_branch_around_the_most_wgmma():
    sass = "\n".join(
        [
            ".L_x_0:",
            "        /*0000*/                   IMAD R1, R2, 0x2, R3 ;",
            "        /*0010*/              @P0 BRA `(.L_x_0) ;",
            ".L_x_1:",
            "        /*0020*/                   HGMMA.64x64x16.F32 R56, R88, gdesc[UR8].tnspB, R56, gsb0 ;",
            "        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            "        /*0040*/              @P1 BRA `(.L_x_1) ;",
        ]
    )
    assert tool.main_loop(sass) == [
        "HGMMA.64x64x16.F32 R56, R88, gdesc[UR8].tnspB, R56, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "@P1 BRA `(.L_x_1)",
    ]


def test_loops_past_0xffff_and_rotated_loops_are_read_and_slow_path_returns_are_not_loops():
    mma = "HGMMA.64x64x16.F32 R56, R88, gdesc[UR8].tnspB, R56, gsb0"
    sass = "\n".join(
        [
            ".L_x_2:",  # a loop whose exit test sits mid-body: its latch is an unpredicated branch
            f"        /*fff0*/                   {mma} ;",
            "        /*10000*/                  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            "        /*10010*/             @P2 BRA `(.L_x_3) ;",
            "        /*10020*/                  IMAD R1, R2, 0x2, R3 ;",
            "        /*10030*/                  BRA `(.L_x_2) ;",
            ".L_x_3:",
            "        /*10040*/                  EXIT ;",
            ".L_x_4:",  # the out-of-line slow path of an mbarrier wait: back into the loop
            "        /*10050*/                  SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;",
            "        /*10060*/             @!P0 BRA `(.L_x_4) ;",
            "        /*10070*/                  BRA `(.L_x_2) ;",
        ]
    )
    assert tool.mma_loops(sass) == [
        [
            mma,
            "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "@P2 BRA `(.L_x_3)",
            "IMAD R1, R2, 0x2, R3",
            "BRA `(.L_x_2)",
        ]
    ]
