"""Every kernel compiles for sm_90 exactly as the layer launches it, on any machine (Triton's
wheel carries ptxas and cuobjdump), and the machine code has the properties we rely on: the
GEMMs use Hopper's warpgroup MMA (HGMMA), shared memory fits an H100/H200 block, and the
staged kernels do not spill. The interpreter accepts code the GPU compiler rejects; this test
sees what the compiler sees without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.tools.aot import SM90_SHARED_LIMIT

ROOT = Path(__file__).resolve().parents[2]
# one xdist worker runs this file, and first (`make test`: --dist loadgroup, which queues the
# largest group first): its module fixture compiles every kernel, ~5 minutes on a fresh CPU
# machine, which two workers would each pay and which, left to the end, is the suite's tail
pytestmark = pytest.mark.xdist_group("sm90_compile")


@pytest.fixture(scope="module")
def compiled_rows() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "moestream.tools.aot", "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return rows


def label(row: dict) -> str:
    """The variant a compiled row belongs to (``moestream.tools.aot``'s label after the kernel's
    ``name[warps, stages]``): "" for the bf16 layer as its staged and fused paths launch it."""
    return row["kernel"].split("]", 1)[1].strip()


@pytest.fixture(scope="module")
def compiled(compiled_rows) -> dict[str, dict]:
    """The bf16 layer's kernels by name, as its staged and fused paths launch them (label
    ""; every other variant is labelled, and matching on what labels end with let fp8 ones
    such as " fp8 grouped" in)."""
    return {r["name"]: r for r in compiled_rows if label(r) == ""}


@pytest.fixture(scope="module")
def compiled_decode(compiled_rows) -> dict[str, dict]:
    """The staged GEMMs in decode pieces (tuning.select for decode calls), bf16 and fp8, by (name, dtype)."""
    return {(r["name"], "fp8" if r["kernel"].endswith(" fp8 decode") else "bf16"): r
            for r in compiled_rows
            if r["kernel"].endswith(" decode") and not r["kernel"].endswith(" fp4w decode")}


@pytest.fixture(scope="module")
def compiled_tail(compiled_rows) -> dict[tuple[str, str], dict]:
    """The staged GEMMs with 32-row tail pieces (Tuning.l1.tail_rows / l2_tail_rows), bf16 and
    fp8, by (name, dtype)."""
    return {(r["name"], "fp8" if r["kernel"].endswith(" fp8 tail") else "bf16"): r
            for r in compiled_rows
            if r["kernel"].endswith(" tail") and r["name"] in ("l1_kernel", "l2_kernel")}


@pytest.fixture(scope="module")
def compiled_fp4w(compiled_rows) -> dict[tuple[str, str], dict]:
    """The fp4w layer's kernels (staged path) by (name, "default" | "decode")."""
    return {(r["name"], "decode" if r["kernel"].endswith(" decode") else "default"): r
            for r in compiled_rows if r["kernel"].endswith((" fp4w", " fp4w decode"))}


@pytest.fixture(scope="module")
def compiled_fp8(compiled_rows) -> dict[str, dict]:
    """The fp8 layer's kernels (staged path) by name."""
    return {r["name"]: r for r in compiled_rows if r["kernel"].endswith(" fp8")}


def test_every_kernel_compiles(compiled):
    assert set(compiled) == {"publish_kernel", "layout_kernel", "dispatch_kernel",
                             "l1_kernel", "l2_kernel", "combine_kernel", "fused_kernel"}


@pytest.mark.parametrize("name", ["l1_kernel", "l2_kernel", "fused_kernel"])
def test_gemms_use_warpgroup_mma(compiled, name):
    assert compiled[name]["hgmma"] > 0, compiled[name]
    assert compiled[name]["hmma"] == 0, compiled[name]


def test_shared_memory_fits_and_staged_kernels_do_not_spill(compiled):
    for name, row in compiled.items():
        assert row["shared_bytes"] <= SM90_SHARED_LIMIT, row
        if name != "fused_kernel":   # the fused kernel's register budget is still being tuned
            assert row["stack_bytes"] == 0, row


def test_buffer_rows_move_in_vectors(compiled_rows):
    # every buffer address comes from an int64 table (kernels/common.peer_ptr): unless the
    # compiler is told the regions are 16-byte aligned, each row copy (dispatch, combine,
    # the GEMM epilogues, publish) compiles to one 1- or 2-byte access per value (slower
    # calls). No layer kernel, in any mode, may have such an access.
    narrow = {r["kernel"]: r["narrow_global"] for r in compiled_rows if r["narrow_global"]}
    assert not narrow, narrow


def test_fp8_layer_gemms_use_fp8_warpgroup_mma(compiled_fp8):
    # the fp8 layer's GEMMs as the staged path and the fused launch run them (dsv3 dims,
    # tuning.gpu_defaults fp8): e4m3 x e4m3 warpgroup MMAs, pipelined (shared memory holds several
    # stages: the byte rows' base pointers carry their 16-byte alignment), and at most a small
    # spill in the staged L1 (two 128x128 fp32 accumulators plus the two fresh per-K-block
    # products: 255 registers); the fused kernel's register budget is not bounded here (as bf16)
    assert set(compiled_fp8) == {"publish_kernel", "layout_kernel", "dispatch_kernel",
                                 "l1_kernel", "l2_kernel", "combine_kernel", "fused_kernel"}
    for name in ("l1_kernel", "l2_kernel", "fused_kernel"):
        row = compiled_fp8[name]
        assert row["e4m3_gmma"] > 0 and row["hgmma"] == 0 and row["hmma"] == 0, row
        assert 2 * 32768 < row["shared_bytes"] <= SM90_SHARED_LIMIT, row
    assert compiled_fp8["l1_kernel"]["stack_bytes"] <= 64, compiled_fp8["l1_kernel"]
    assert compiled_fp8["l2_kernel"]["stack_bytes"] == 0, compiled_fp8["l2_kernel"]


def test_resident_programs_of_the_staged_gemms(compiled, compiled_fp8, compiled_rows):
    """The staged GEMM grids are sized by what one SM holds at once (programs):
    the fp8 L1 (147 KB of shared memory), the bf16 L1 (196 KB), the bf16 L2 (128x256, 8 warps,
    ~210 KB) and the fp8 L2 at dsv3's K (128-row tile, 8 warps) run one program per SM; the
    bf16 L2 where hidden is no multiple of 256 (128x128, 4 warps, ~100 KB) and the fp8 L2 at a
    short K (64-row pieces, 4 warps, 82 KB) two, so that one's epilogue overlaps the other's
    MMAs. No L2 spills. A grid twice the SM count for a kernel one SM holds once runs
    as two passes one after another."""
    from moestream.launch import resident_per_sm

    def fit(row):
        assert row["name"] != "l2_kernel" or row["stack_bytes"] == 0, row
        return resident_per_sm(registers=row["registers"], shared_bytes=row["shared_bytes"],
                               warps=row["num_warps"])

    by_label = {(r["name"], label(r)): r for r in compiled_rows}
    assert fit(compiled["l1_kernel"]) == 1, compiled["l1_kernel"]
    assert fit(by_label["l2_kernel", ""]) == 1, by_label["l2_kernel", ""]
    assert fit(by_label["l2_kernel", "l2 128"]) == 2, by_label["l2_kernel", "l2 128"]
    assert fit(compiled_fp8["l1_kernel"]) == 1, compiled_fp8["l1_kernel"]
    assert fit(compiled_fp8["l2_kernel"]) == 1, compiled_fp8["l2_kernel"]   # 128-row tile
    assert fit(by_label["l2_kernel", "fp8 short k"]) == 2   # 64-row pieces


def test_decode_pieces_use_warpgroup_mma_without_spills(compiled_decode):
    # weights as the MMA row operand with 16 token columns: bf16 HGMMA / e4m3 GMMA, no
    # spill in the K loops; every decode GEMM fits two programs per SM (the fp8 L1, 128
    # wide: one scale group, in 3 stages). The fp8 L1, at 255 registers, keeps 8 B of stack
    # outside its K loops (two values per block) since the GEMMs take their block count
    # and meta from the host's base address; the others none
    from moestream.launch import resident_per_sm
    want_fit = {("l1_kernel", "bf16"): 2, ("l2_kernel", "bf16"): 2,
                ("l1_kernel", "fp8"): 2, ("l2_kernel", "fp8"): 2}
    assert set(want_fit) <= set(compiled_decode), sorted(compiled_decode)
    for key, fit in want_fit.items():
        row = compiled_decode[key]
        mma = row["e4m3_gmma"] if key[1] == "fp8" else row["hgmma"]
        assert mma > 0 and row["hmma"] == 0, row
        assert all(lp["local_ops"] == 0 for lp in row["loops"] if lp["mma"]), row["loops"]
        assert row["stack_bytes"] <= (8 if key == ("l1_kernel", "fp8") else 0), row
        assert resident_per_sm(registers=row["registers"], shared_bytes=row["shared_bytes"],
                               warps=row["num_warps"]) == fit, row


def test_only_decode_pieces_store_with_a_cache_policy(compiled_rows):
    # kernels/common.DECODE_STORE_EVICT: decode pieces store what the next launch reads at L2
    # evict_last priority: the L2's combine slots (bf16 and fp8, staged and fused, split-K or
    # not) and the L1's pool_act rows (bf16, and fp8 values and scales, split-K or not).
    # Whole tiles and tail pieces (whose stores can be all of combine_y, a block per expert
    # of pool_act), fp4w's L1 and 16-row L2 pieces and every other kernel store at normal
    # priority
    def hinted(row):
        words = label(row).split()
        return ("decode" in words and "fp4w" not in words
                and row["name"] in ("l1_kernel", "l2_kernel", "fused_kernel"))
    want = sorted(r["kernel"] for r in compiled_rows if hinted(r))
    # L2: decode, host, fp8 (host, split, ptr); L1: decode, host, fp8 (host, split, ptr);
    # fused: bf16, host, fp8
    assert len(want) >= 14, want
    assert sorted(r["kernel"] for r in compiled_rows if r["hinted_stores"]) == want


def test_host_descriptors_leave_no_descriptor_to_build(compiled_rows):
    # Tuning.host_descriptors (a CUDA graph capture): the staged GEMMs and the fused launch
    # take their descriptors as kernel parameters, so their SASS makes none visible to the
    # TMA unit (UTMACCTL) where the same kernels building them do; same MMAs, no spill
    by_label = {(r["name"], r["kernel"].split(" ", 1)[1] if " " in r["kernel"] else ""): r
                for r in compiled_rows
                if r["name"] in ("l1_kernel", "l2_kernel", "fused_kernel")}
    pairs = {"l1_kernel": [("host", ""), ("decode host", "decode"),
                           ("fp8 decode host", "fp8 decode")],
             "fused_kernel": [("fused host", "gpu-default"),
                              ("fused decode host", "fused decode")]}
    pairs["l2_kernel"] = pairs["l1_kernel"]
    for name, kinds in pairs.items():
        for host, built in kinds:
            h = by_label[name, host]
            b = by_label[name, built]
            assert h["tensormap_fences"] == 0 < b["tensormap_fences"], (h, b)
            assert h["stack_bytes"] == 0 and (h["hgmma"], h["e4m3_gmma"]) == (
                b["hgmma"], b["e4m3_gmma"]), (h, b)


def test_tail_pieces_keep_the_tiles_resident(compiled_tail, compiled, compiled_fp8):
    # the usual tile and the tail piece in one kernel: both warpgroup MMAs (twice the count),
    # no new spill, and at least as many programs per SM as the kernel without pieces (the
    # grid is sized from it)
    from moestream.launch import resident_per_sm
    assert set(compiled_tail) == {("l1_kernel", "bf16"), ("l2_kernel", "bf16"),
                                  ("l1_kernel", "fp8"), ("l2_kernel", "fp8")}

    def fit(row):
        return resident_per_sm(registers=row["registers"], shared_bytes=row["shared_bytes"],
                               warps=row["num_warps"])
    for (name, dtype), row in compiled_tail.items():
        base = (compiled_fp8 if dtype == "fp8" else compiled)[name]
        mma = "e4m3_gmma" if dtype == "fp8" else "hgmma"
        assert row[mma] > base[mma] > 0 and row["hmma"] == 0, row
        # no spill inside the K loops, and little outside them: the fp8 L1 keeps 24 B of
        # stack outside its loops (the kernel without pieces 8 B)
        assert all(lp["local_ops"] == 0 for lp in row["loops"] if lp["mma"]), row["loops"]
        assert row["stack_bytes"] <= max(base["stack_bytes"], 32), (row, base)
        assert fit(row) >= fit(base), (row, base)


@pytest.mark.parametrize("regs,shared,warps,want", [
    (255, 0, 8, 1),          # 255 -> 256 registers x 256 threads: the whole register file
    (128, 0, 8, 2),          # 128 x 256 = 32768 registers: two blocks
    (129, 0, 8, 1),          # rounded up to 136 per thread: 69632 > 65536 for two
    (32, 0, 4, 16),          # threads (2048 per SM) bound it: 16 blocks of 128
    (32, 115712, 4, 2),      # 113 KB + 1 KB reserved, twice: 233472 bytes exactly
    (32, 115713, 4, 1),      # one byte more does not fit twice
    (16, 0, 1, 32),          # the block limit
])
def test_resident_per_sm_limits(regs, shared, warps, want):
    from moestream.launch import resident_per_sm
    assert resident_per_sm(registers=regs, shared_bytes=shared, warps=warps) == want


def test_fp4w_layer_gemms(compiled_fp4w):
    # the fp4w layer's GEMMs (dsv3 dims, tuning.gpu_defaults "fp4w" and its decode form): the
    # MXFP4 tiles decoded by the PTX bit operations feed fp8 warpgroup MMAs in 64-row pieces
    # and fp16 warp MMAs (the e4m3 values widened exactly) in the decode form's 16-row pieces;
    # shared memory fits; the 16-row pieces do not spill
    names = {n for n, _ in compiled_fp4w}
    assert {"publish_kernel", "dispatch_kernel", "l1_kernel", "l2_kernel"} <= names
    for form, mma in (("default", "qgmma"), ("decode", "hmma")):
        for name in ("l1_kernel", "l2_kernel"):
            row = compiled_fp4w[(name, form)]
            assert row[mma] > 0 and row["hgmma"] == 0, row
            assert row["shared_bytes"] <= SM90_SHARED_LIMIT, row
            if form == "decode":
                assert row["stack_bytes"] == 0, row


def test_fp8_decode_l1_split_compiles_by_descriptor_and_by_pointer(compiled_rows):
    # the fp8 decode L1's split-K parts (Tuning.l1.split_k) in both load forms compile, with
    # e4m3 warpgroup MMAs only and no spill in the K loops. The pointer form can fail to
    # compile for the GPU (if the bf16 part is compiled into the fp8 kernel) while the
    # interpreter runs it
    rows = {label(r): r for r in compiled_rows
            if r["name"] == "l1_kernel" and label(r).startswith("fp8 decode split")}
    assert set(rows) == {"fp8 decode split", "fp8 decode split ptr"}, sorted(rows)
    for r in rows.values():
        assert r["e4m3_gmma"] > 0 and r["hgmma"] == 0 and r["hmma"] == 0, r
        assert all(lp["local_ops"] == 0 for lp in r["loops"] if lp["mma"]), r["loops"]


def test_one_dot_l1_launches_at_its_own_depth(compiled_rows):
    # Tuning.l1.one_dot_stages reaches the one-MMA L1's launch (3 stages where for_call
    # picks them, from hidden 4096): the same K loop of 256-wide HGMMAs in less shared memory
    # than the GPU defaults' 4 stages, no stack
    rows = {label(r): r for r in compiled_rows
            if r["name"] == "l1_kernel" and label(r) in ("one dot", "one dot s3")}
    four, three = rows["one dot"], rows["one dot s3"]
    assert (four["num_stages"], three["num_stages"]) == (4, 3), (four, three)
    assert three["shared_bytes"] < four["shared_bytes"] <= SM90_SHARED_LIMIT
    assert three["hgmma"] == four["hgmma"] > 0 and three["stack_bytes"] == 0, three


def test_gemm_k_loops_do_not_spill(compiled_rows):
    # the innermost SASS loops with MMAs are the GEMMs' K loops (a flat L2's tile loop holds its
    # epilogue too): none of the staged or fused bf16 / fp8 GEMMs, in any launch form compiled
    # above, touches local memory inside them. A spill outside (the fp8 L1's 32 B, the fused
    # kernel's) costs per tile, one inside per K step. fp4w's 64-row pieces are the known
    # exception, reported in the message if they change.
    gemms = [r for r in compiled_rows if r["name"] in ("l1_kernel", "l2_kernel", "fused_kernel")]
    assert len(gemms) >= 20
    for r in gemms:
        k_loops = [lp for lp in r["loops"] if lp["mma"]]
        assert k_loops, r["kernel"]                     # every GEMM has a K loop with MMAs
        if r["kernel"].endswith(" fp4w"):
            continue
        assert all(lp["local_ops"] == 0 for lp in k_loops), (r["kernel"], k_loops)


def test_sass_loops_and_hash_read_cuobjdump_text():
    # the SASS helpers on a hand-written listing: one loop inside another (only the inner one
    # counts), its MMAs and spills, and a hash that ignores addresses and parameter offsets
    # but not registers
    from moestream.tools.aot import sass_hash, sass_instructions, sass_loops
    text = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;  /* 0x0 */
        /*0020*/                   STL [R1+0x10], R2 ;                    /* 0x0 */
        /*0030*/               @P0 BRA 0x10 ;                             /* 0x0 */
        /*0040*/                   LDL R2, [R1+0x10] ;                    /* 0x0 */
        /*0050*/               @P1 BRA 0x0 ;                              /* 0x0 */
        /*0060*/                   EXIT ;                                 /* 0x0 */
    """
    ins = sass_instructions(text)
    assert len(ins) == 7 and ins[1] == (0x10, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24")
    assert sass_loops(ins) == [dict(start=0x10, instructions=3, mma=1, local_ops=1)]
    moved = [(a + 0x100, t.replace("BRA 0x10", "BRA 0x110").replace("BRA 0x0", "BRA 0x100")
              .replace("c[0x0][0x28]", "c[0x0][0x30]")) for a, t in ins]
    assert moved[3][1] == "@P0 BRA 0x110" and moved[0][1] == "LDC R1, c[0x0][0x30]"
    assert sass_hash(moved) == sass_hash(ins)
    renamed = [(a, t.replace("R24", "R26")) for a, t in ins]
    assert sass_hash(renamed) != sass_hash(ins)


def test_fused_forms_of_decode_calls():
    # `moestream.tools.aot --fused-forms` on qwen3 bf16 at 1 and 8 tokens (decode pieces, one
    # rank with in-kernel and host descriptors, two virtual ranks): every call is listed under
    # exactly one compiled form; each form uses warpgroup MMAs, fits shared memory, keeps its
    # K loops free of spills and fits the two programs per SM the policy launches it with
    from moestream.launch import resident_per_sm
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "moestream.tools.aot", "--fused-forms",
                          "--shapes", "qwen3", "--dtypes", "bf16", "--tokens", "1,8", "--json"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    forms = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    users = sorted(u for f in forms for u in f["users"])
    assert users == sorted(f"qwen3 bf16 T={T} R={R}{host}" for T in (1, 8)
                           for R, host in ((1, ""), (1, " host"), (2, "")))
    for f in forms:
        assert f["name"] == "fused_kernel" and f["hgmma"] > 0 and f["hmma"] == 0, f
        assert f["shared_bytes"] <= SM90_SHARED_LIMIT, f
        assert all(lp["local_ops"] == 0 for lp in f["loops"] if lp["mma"]), f["loops"]
        assert resident_per_sm(registers=f["registers"], shared_bytes=f["shared_bytes"],
                               warps=f["num_warps"]) >= 2, f
