"""vLLM's own account kept with a calibration: stored (and migrated), shown in a serve's view,
and used to refuse a start whose kv_cache_mib cannot fit beside what the serve holds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gpud.config import parse_config
from gpud.core.launch import fingerprint
from gpud.core.sizing import MIB
from gpud.ctl.format import format_serve
from gpud.durable.store import MIGRATIONS, Calibration, Changes, Store
from gpud.life.calibration import Calibrator
from gpud.life.service import LedgerService

CONFIG = """
[daemon]
admission = "ledger"
[roles.r]
device = "0"
capacity_mib = 40000
[serves.v]
role = "r"
vram_mib = 20000
port = 30001
[serves.v.vllm]
model = "m"
kv_cache_mib = 8000
"""
VLLM = {"weights_mib": 9000, "kv_cache_mib": 8000, "cudagraph_mib": 600, "context_mib": 700,
        "recommended_kv_cache_bytes": None, "recommended_kv_cache_mib": None}


class NoObserver:
    def device_total(self, device: str) -> int | None:
        return None


def calibrator(tmp_path: Path, config: str = CONFIG, vllm: dict | None = VLLM) -> Calibrator:
    cfg = parse_config(config, "test")
    store = Store(tmp_path / "gpud.sqlite3")
    svc = LedgerService(cfg, store)
    svc.load()
    store.commit(Changes(calibrations=[Calibration(
        "v", fingerprint(cfg.serves["v"]), 1.0, 60.0, 60, 17500, 17900, 18400, vllm)]))
    cal = Calibrator(svc, NoObserver())  # type: ignore[arg-type]
    cal.load()
    return cal


def test_vllm_figures_survive_a_reopen_and_a_migration(tmp_path: Path) -> None:
    calibrator(tmp_path).svc.store.close()
    assert Store(tmp_path / "gpud.sqlite3").calibrations()[0].vllm == VLLM
    old = tmp_path / "v3.db"
    db = sqlite3.connect(old)
    db.executescript(";".join(MIGRATIONS[:3]) + "; PRAGMA user_version=3;")
    db.execute("INSERT INTO calibrations VALUES ('v', 'f', 1.0, 60.0, 60, 1, 2, 3)")
    db.commit()
    db.close()
    [migrated] = Store(old).calibrations()
    assert (migrated.recommended_mib, migrated.vllm) == (3, None)


def test_a_kv_cache_that_cannot_fit_beside_the_weights_is_named(tmp_path: Path) -> None:
    cal = calibrator(tmp_path)
    assert cal.sizing_problem("v") is None  # 9000 + 600 + 700 + 8000 = 18300 <= 20000
    tight = calibrator(tmp_path / "x", CONFIG.replace("kv_cache_mib = 8000",
                                                      "kv_cache_mib = 9800"))
    assert tight.sizing_problem("v") == (
        "calibrated need 20100 MiB (weights 9000 + CUDA graphs 600 + context 700 + kv_cache_mib "
        "9800) exceeds vram_mib 20000: vLLM would draw past its reservation")
    assert calibrator(tmp_path / "y", vllm=None).sizing_problem("v") is None


def test_the_serve_view_shows_vllms_account_beside_the_measured_figures(tmp_path: Path) -> None:
    brief = calibrator(tmp_path).summary_of("v")
    assert brief == {"steady_mib": 17500, "peak_mib": 17900, "recommended_mib": 18400,
                     "vllm": VLLM}
    text = format_serve({"name": "v", "calibrated": brief})
    assert ("calibrated:  steady 17500 MiB, peak 17900 MiB, recommended reservation 18400 MiB; "
            "vLLM: weights 9000 MiB, KV cache 8000 MiB, CUDA graphs 600 MiB, context 700 MiB"
            in text), text


async def test_the_v2_runners_graph_pool_counts_for_a_kv_cache_mib_serve(tmp_path: Path) -> None:
    # vLLM 0.33's default (V2) model runner logs no "Estimated CUDA graph memory", and with
    # --kv-cache-memory-bytes no KV line: the graph pool is known from "Graph capturing
    # finished ... took X GiB" alone, and a kv_cache_mib serve must fit it too.
    lines = [
        "(EngineCore pid=7) INFO [gpu_model_runner.py:5150] Model loading took 11.49 GiB memory "
        "and 18.250000 seconds",
        "(EngineCore pid=7) INFO [model_runner.py:1128] Graph capturing finished in 8 secs, "
        "took 0.31 GiB",
    ]

    async def journal(unit: str) -> list[str]:
        assert unit == "gpud-serve-v.service"
        return lines

    cal = calibrator(tmp_path, vllm=None)
    cal.journal = journal
    figures = await cal.vllm_figures("v", 20000)
    assert figures is not None
    assert (figures["weights_mib"], figures["cudagraph_mib"], figures["kv_cache_mib"]) == (
        11766, 317, None)
    fitted = calibrator(tmp_path / "x", vllm=figures)
    assert fitted.sizing_problem("v") == (
        "calibrated need 20083 MiB (weights 11766 + CUDA graphs 317 + context 0 + kv_cache_mib "
        "8000) exceeds vram_mib 20000: vLLM would draw past its reservation")


def test_a_util_sized_calibration_gives_the_kv_cache_that_fits_exactly(tmp_path: Path) -> None:
    """From a util-sized start's figures: vram_mib less the context, less what vLLM's budget
    held besides its KV cache (budget - its own recommendation), less the margin."""
    from gpud.ctl.format import format_calibration

    util_sized = CONFIG.replace("kv_cache_mib = 8000\n", "")
    figures = {**VLLM, "budget_mib": 19000, "kv_cache_mib": 9200, "context_mib": 700,
               "recommended_kv_cache_mib": 9000}
    view = calibrator(tmp_path, util_sized, figures).view("v")
    vllm = view.get("vllm") or {}
    # 20000 - 700 - (19000 - 9000) - max(64, 2% of 20000)
    assert vllm["kv_cache_fit_mib"] == 20000 - 700 - 10000 - 400
    text = format_calibration(view)
    assert "KV cache to fit the reservation exactly: 8900 MiB (vram_mib 20000 - context 700 - " \
        "weights, activation peak and CUDA graphs 10000 - margin 400); in [serves.v.vllm]: " \
        "kv_cache_mib = 8900" in text, text


def test_an_exactly_sized_calibration_says_why_it_gives_no_figure(tmp_path: Path) -> None:
    from gpud.ctl.format import format_calibration

    view = calibrator(tmp_path).view("v")  # sized in bytes: no budget to go by
    assert (view.get("vllm") or {})["kv_cache_fit_mib"] is None
    assert "KV cache to fit the reservation exactly: no figure: the calibration needs a " \
        "util-sized start's vLLM lines" in format_calibration(view)


def test_the_calibration_shows_the_checkpoints_prediction_beside_vllms(tmp_path: Path) -> None:
    """A vllm serve's calibration view carries what its checkpoint on disk predicts, and the
    text sets it beside vLLM's measured weights; a model not on disk says unknown."""
    from gpud.ctl.format import format_calibration
    from tests.checkpoints import write_checkpoint

    model = write_checkpoint(tmp_path / "model")  # tests.checkpoints.LLAMA_CONFIG: 4 MiB bf16
    cal = calibrator(tmp_path / "a", CONFIG.replace('model = "m"', f'model = "{model}"'),
                     {**VLLM, "weights_mib": 5})
    view = cal.view("v")
    kv = view["predicted"].pop("kv")
    # weights and CUDA graphs as the calibration measured them; no budget recorded (an exactly
    # sized serve), so the activation peak stays gpud's estimate, and says so
    assert [(d["name"], d["source"]) for d in kv["deductions"]] == [
        ("weights", "measured"), ("context", "configured"), ("activation peak", "estimated"),
        ("CUDA graphs", "measured")]
    assert [d["mib"] for d in kv["deductions"]][0::3] == [5, 600]
    # kv_cache_mib = 8000: vLLM's KV cache is that figure; 2 layers x 512 bytes a token
    assert (kv["kv_from"], kv["kv_at_mib"], kv["kv_tokens"]) == ("vllm.kv_cache_mib", 8000,
                                                                  8000 * MIB // 1024)
    assert view["predicted"] == {
        "weights_mib": 4, "kv_mib": 8000, "context_mib": 512, "minimum_mib": 8516,
        "max_model_len": 4096,
        "how": f"weights 4 + KV for one 4096-token sequence 8000 + context 512 = 8516 MiB; "
               f"weights bf16; RoPE cache 0.5 MiB, read from {model} (21 tensors in "
               "model.safetensors)"}
    text = format_calibration(view)
    assert ("predicted from the checkpoint: minimum 8516 MiB (weights 4 + KV for one "
            "4096-token sequence 8000 + context 512); vLLM measured weights 5 MiB: predicted "
            "-20.0%") in text, text
    absent = calibrator(tmp_path / "b").view("v")
    assert absent["predicted"]["minimum_mib"] is None
    assert ("predicted from the checkpoint: unknown (m@main: not in the model cache "
            "/var/cache/gpud-serve/huggingface/hub: unknown until its first start)"
            in format_calibration(absent))


def test_calibration_closes_the_loop(tmp_path: Path) -> None:
    """A util-sized serve: before a start the reservation's KV cache is an estimate; once
    calibrated, the activation peak is vLLM's own (budget - weights - KV - graphs), and the
    prediction then gives back the KV tokens vLLM logged."""
    from gpud.ctl.format import format_calibration
    from tests.checkpoints import write_checkpoint

    model = write_checkpoint(tmp_path / "model")
    config = CONFIG.replace('model = "m"', f'model = "{model}"').replace(
        "kv_cache_mib = 8000\n", "")
    before = calibrator(tmp_path / "a", config, None).view("v")["predicted"]["kv"]
    assert {d["source"] for d in before["deductions"][2:]} == {"estimated"}
    assert before["logged_kv_tokens"] is None
    # vLLM's start on 20000 MiB: weights 9000, KV 8000 (8,192,000 tokens of 1024 bytes in
    # blocks of 16), graphs 600; its budget the whole reservation (no vllm.context_mib)
    figures = {**VLLM, "budget_mib": 20000, "kv_cache_tokens": 8_192_000,
               "kv_max_concurrency": 2000.0}
    view = calibrator(tmp_path / "b", config, figures).view("v")
    kv = view["predicted"]["kv"]
    assert [(d["name"], d["mib"], d["source"]) for d in kv["deductions"]] == [
        ("weights", 9000, "measured"), ("context", 0, "configured"),
        ("activation peak", 2400, "measured"), ("CUDA graphs", 600, "measured")]
    assert (kv["kv_at_mib"], kv["kv_tokens"], kv["logged_kv_tokens"]) == (8000, 8_192_000,
                                                                          8_192_000)
    assert kv["max_concurrency"] == 2000.0 and kv["sequences"] == 1999
    text = format_calibration(view)
    assert "KV cache tokens: predicted 8,192,000, vLLM logged 8,192,000 (+0.0%)" in text, text
    assert "activation peak 2400 (measured)" in text
