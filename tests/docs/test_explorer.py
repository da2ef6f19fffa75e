"""The schedule explorer (docs/explorer.md): its data is recorded from the code, and what the
page shows is what the schedule says.

One recording of a small grid at world size 2 (the three implementations, prefetch one and two
ahead, fp32 and bf16: 12 settings on one launch of ranks) is shared by the module. Two of its
settings are recorded again on their own with ``record_step``, as ``twinshard schedule`` does,
and the page's numbers are held to that schedule and to its printed table. One launch fails on
purpose. The last tests read the site's build: its hook, its whole grid (2 and 4 ranks,
``reshard_after_forward=2``), the tutorials' links into it, and the page in Chromium at 420
and 1400 pixels (the session's site, shared with tests/docs/test_docs.py), driven by
``support/explorer_probe.html``: it steps, walks every control and switches ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import re
import types
import urllib.parse

import pytest
from docs_site import hook_module, load_hook, probe

from twinshard.measure.schedule import format_table, record_step
from twinshard.measure.units import human_bytes

explore = hook_module("explorer_data")  # the recorder the docs build's hook calls
page = hook_module("explorer_page")  # what the page shows, from the recordings
RecordingFailed, Setting = explore.RecordingFailed, explore.Setting

ROOT = pathlib.Path(__file__).resolve().parents[2]
AXES = dict(
    impl=("reference", "optimized", "torch"),
    world=(2,),
    reshard=(True,),
    prefetch=(1, 2),
    dtype=("fp32", "bf16"),
)


@pytest.fixture(scope="module")
def recorded():
    return explore.record_grid(explore.grid(AXES))


@pytest.fixture(scope="module")
def data(recorded):
    return json.loads(json.dumps(page.page_data(recorded, AXES)))  # as the browser reads it


@pytest.fixture(scope="module")
def site_data(site):
    """The built site's schedules: the whole grid."""
    return json.loads((site / "explorer" / "schedules.json").read_text(encoding="utf-8"))


# --- the page's numbers against the schedule --------------------------------------------------
FRESH = [Setting("optimized", 2, True, 2, "bf16"), Setting("reference", 2, True, 1, "fp32")]


@pytest.mark.parametrize("setting", FRESH, ids=lambda s: s.key)
def test_the_pages_totals_are_the_tables(setting, data):
    fresh = record_step(setting.impl, setting.world, **setting.policies())
    shown = data["schedules"][setting.key]
    table = format_table(fresh)
    by_op = shown["totals"]["by_op"]
    assert by_op, "a step issues collectives"
    for t in by_op:
        calls = fresh.calls(t["op"])
        assert (t["count"], t["bytes"]) == (len(calls), sum(c.nbytes for c in calls)), t["op"]
        assert f"{t['count']} {t['op']} ({t['size']})" in table.splitlines()[-1]
    assert {t["op"] for t in by_op} == {c.op for c in fresh.collectives}
    assert shown["totals"]["count"] == len(fresh.collectives)
    assert shown["totals"]["bytes"] == sum(c.nbytes for c in fresh.collectives)
    assert shown["totals"]["sent"] == sum(c["sent"] for c in shown["collectives"])
    for c in shown["collectives"]:  # a rank sends all but its own share of a gather or scatter
        if c["op"] in ("all_gather", "reduce_scatter"):
            assert 0 < c["sent"] < c["bytes"], c
    peak = max(e.unsharded_bytes for e in fresh.events)
    assert shown["peaks"]["unsharded"]["bytes"] == peak
    assert table.endswith(f"peak unsharded {shown['peaks']['unsharded']['size']}")
    # event by event and collective by collective, what the table's rows say; G (being
    # gathered) stands where the table has the parameters' own letter, never for U
    assert [
        (e["hook"], e["group"], e["sharded"], e["unsharded"], e["grads"]) for e in shown["events"]
    ] == [
        (e.hook, e.group or "root", e.sharded_bytes, e.unsharded_bytes, e.grad_bytes)
        for e in fresh.events
    ]
    for e, fresh_event in zip(shown["events"], fresh.events):
        for letter, g in zip(e["states"], fresh.groups):
            assert letter in ("G", fresh.group_state(fresh_event, g)) and (
                letter != "G" or fresh.group_state(fresh_event, g) != "U"
            ), (e, g)
    assert [
        (c["op"], c["dtype"], c["bytes"], c["ranks"], c["blocking"], c["event"])
        for c in shown["collectives"]
    ] == [(c.op, c.dtype, c.nbytes, c.ranks, c.blocking, c.event) for c in fresh.collectives]
    assert shown["command"].startswith(f"twinshard schedule --impls {setting.impl} ")


def test_the_grid_covers_every_combination_it_declares(data):
    declared = list(itertools.product(*explore.AXES.values()))
    full = explore.grid()
    assert [dataclasses.astuple(s) for s in full] == declared
    assert len({s.key for s in full}) == len(declared)
    # the page's data: one schedule per combination of its axes, under the key the page builds
    # (each value lower-cased, joined by |), and each is the setting it is filed under
    wanted = {
        "|".join(str(v).lower() for v in c) for c in itertools.product(*data["axes"].values())
    }
    assert set(data["schedules"]) == wanted
    for key, s in data["schedules"].items():
        impl, world, _, _, dtype = key.split("|")
        assert (s["impl"], s["world"]) == (impl, int(world))
        gathered = {c["dtype"] for c in s["collectives"] if c["op"] == "all_gather"}
        assert gathered == {"bfloat16" if dtype == "bf16" else "float32"}, key


def test_a_missing_combination_is_refused(recorded):
    partial = dict(recorded)
    gone = Setting("torch", 2, True, 2, "bf16")
    del partial[gone]
    with pytest.raises(ValueError, match=re.escape(gone.label)):
        page.page_data(partial, AXES)


def test_each_peak_and_its_attribution_follow_the_memory_series(data):
    for key, s in data["schedules"].items():
        series = {
            "unsharded": [e["unsharded"] for e in s["events"]],
            "with_grads": [e["unsharded"] + e["grads"] for e in s["events"]],
        }
        for name, values in series.items():
            peak = s["peaks"][name]
            assert peak["bytes"] == max(values) > 0, (key, name)
            assert peak["event"] == values.index(max(values)), (key, name)
            assert peak["size"] == human_bytes(peak["bytes"])
            event = s["events"][peak["event"]]
            assert (peak["hook"], peak["group"]) == (event["hook"], event["group"])
            held = [g for g, state in zip(s["groups"], event["states"]) if state == "U"]
            assert peak["unsharded"] == held, (key, name)
            assert set(peak["gathering"]) == gathered_since(s, peak["event"]), (key, name)
            assert peak["unsharded"] or peak["gathering"], f"{key}: a peak that holds nothing"


def gathered_since(s: dict, index: int) -> set[str]:
    """The groups of schedule ``s`` with an all-gather issued by event ``index`` and no U
    state from that event on: being gathered right after ``index``."""
    found = set()
    for c in s["collectives"]:
        if c["op"] != "all_gather" or c["event"] is None or c["event"] > index or not c["group"]:
            continue
        j = s["groups"].index(c["group"])
        if all(s["events"][i]["states"][j] != "U" for i in range(c["event"], index + 1)):
            found.add(c["group"])
    return found


def test_a_group_being_gathered_is_shown_so_and_counted(data):
    seen = 0
    for key, s in data["schedules"].items():
        for i, e in enumerate(s["events"]):
            marked = {g for g, state in zip(s["groups"], e["states"]) if state == "G"}
            assert marked == gathered_since(s, i), (key, i)
            assert not marked or e["unsharded"] > 0, (key, i)  # its buffer is in memory
            seen += len(marked)
    # the optimized path prefetches asynchronously: some group is always shown in flight
    assert any("G" in e["states"] for e in data["schedules"]["optimized|2|true|1|fp32"]["events"])
    assert seen


def gathered_in(s: dict, hook: str, group: str) -> list[str]:
    """The groups whose all-gathers a hook issued."""
    (e,) = [e for e in s["events"] if (e["hook"], e["group"]) == (hook, group)]
    return [
        s["collectives"][i]["group"]
        for i in e["collectives"]
        if s["collectives"][i]["op"] == "all_gather"
    ]


@pytest.mark.parametrize("impl", ["optimized", "torch"])
def test_prefetch_two_gathers_two_blocks_ahead(data, impl):
    one, two = (data["schedules"][f"{impl}|2|true|{n}|fp32"] for n in (1, 2))
    assert gathered_in(one, "pre_forward", "root") == ["root", "blocks.0"]
    assert gathered_in(two, "pre_forward", "root") == ["root", "blocks.0", "blocks.1"]
    assert gathered_in(two, "pre_forward", "blocks.0") == ["blocks.2"]
    assert two["peaks"]["unsharded"]["bytes"] > one["peaks"]["unsharded"]["bytes"]


def test_the_reference_ignores_prefetch_lists_and_the_page_says_so(data):
    one, two = (data["schedules"][f"reference|2|true|{n}|fp32"] for n in (1, 2))
    strip = lambda s: (s["events"], s["collectives"], s["totals"], s["peaks"])  # noqa: E731
    assert strip(one) == strip(two)
    assert all(c["blocking"] for c in one["collectives"])
    # the page disables "two ahead" for the reference, with the reason; the others differ
    assert "ignores prefetch lists" in one["alike"]["prefetch"]["2"]
    assert "ignores prefetch lists" in two["alike"]["prefetch"]["1"]
    for impl in ("optimized", "torch"):
        assert "prefetch" not in data["schedules"][f"{impl}|2|true|1|fp32"]["alike"], impl


def test_the_legend_names_only_what_occurs(data, site_data):
    for d in (data, site_data):
        states = {x for s in d["schedules"].values() for e in s["events"] for x in e["states"]}
        ops = {c["op"] for s in d["schedules"].values() for c in s["collectives"]}
        assert set(d["states"]) == states and set(d["ops"]) == ops
        assert len(d["states"]) == len(set(d["states"])) and len(d["ops"]) == len(set(d["ops"]))
    assert "P" not in data["states"]  # no reshard_after_forward=2 in this module's small grid
    # the site's grid has the post-forward piece (reshard_after_forward=2 at 4 ranks) and groups
    # being gathered
    assert {"U", "S", "P", "G"} <= set(site_data["states"])


def test_more_ranks_hold_smaller_shards_and_send_more(site_data):
    schedules = site_data["schedules"]
    for impl in site_data["axes"]["impl"]:
        two, four = (schedules[f"{impl}|{n}|true|1|fp32"] for n in (2, 4))
        assert two["totals"]["bytes"] == four["totals"]["bytes"], impl  # the same buffers
        assert 1.9 < two["param_shards"] / four["param_shards"] <= 2, impl  # 1/N, padded
        assert four["totals"]["sent"] > two["totals"]["sent"], impl  # (N-1)/N of each


def test_two_ahead_is_a_trade_off_not_the_whole_model(site_data):
    for impl in ("optimized", "torch"):
        one, two = (site_data["schedules"][f"{impl}|2|true|{n}|fp32"] for n in (1, 2))
        peak = two["peaks"]["unsharded"]
        assert peak["bytes"] > one["peaks"]["unsharded"]["bytes"], impl  # more ahead holds more
        # but never every group at once: some block is still sharded at the peak
        assert len(peak["unsharded"]) + len(peak["gathering"]) < len(two["groups"]), impl


TUTORIAL_LINKS = {  # tutorial -> (setting, the axis compared or None)
    "03_shard_a_layer": ("reference|2|true|1|fp32", None),
    "06_reference_to_optimized": ("optimized|2|true|1|fp32", "impl"),
    "07_your_own_variant": ("optimized|2|true|1|fp32", "prefetch"),
}


@pytest.mark.parametrize("tutorial", TUTORIAL_LINKS)
def test_each_tutorial_links_to_its_own_setting(tutorial, site_data):
    notebook = json.loads((ROOT / "tutorials" / f"{tutorial}.ipynb").read_text(encoding="utf-8"))
    text = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    links = re.findall(r"\(\.\./\.\./explorer/#([^)]*)\)", text)
    assert links, f"{tutorial} does not link to a view of the explorer"
    for link in links:
        found = re.fullmatch(r"setting=([^&]+)&compare=(-?\d+)&event=(\d+)", link)
        assert found, link  # the address the explorer restores (explorer.js, restore)
        key, compare = urllib.parse.unquote(found.group(1)), int(found.group(2))
        want_key, want_axis = TUTORIAL_LINKS[tutorial]
        assert key == want_key and key in site_data["schedules"], link
        axis = site_data["comparisons"][compare]["axis"] if compare >= 0 else None
        assert axis == want_axis, link


# --- failures name the setting ----------------------------------------------------------------
def test_a_bad_implementation_is_named_before_any_rank_starts():
    bad = Setting("no_such_fsdp", 2, True, 1, "fp32")
    with pytest.raises(RecordingFailed, match=re.escape(bad.label) + ".*--impls 'no_such_fsdp'"):
        explore.record_grid([Setting("optimized", 2, True, 1, "fp32"), bad])


def test_a_recording_that_fails_on_a_rank_is_named(monkeypatch):
    real = explore.record_on_rank

    def broken(impl, **policies):  # the ranks are forked: they see this recorder
        if policies["prefetch"] == 2:
            raise RuntimeError("the recorder broke")
        return real(impl, **policies)

    monkeypatch.setattr(explore, "record_on_rank", broken)
    good, bad = Setting("torch", 2, True, 1, "fp32"), Setting("torch", 2, True, 2, "fp32")
    with pytest.raises(RecordingFailed, match=re.escape(f"failed to record {bad.label}")):
        explore.record_grid([good, bad], timeout=120)


def test_a_failed_recording_fails_the_build_naming_the_setting(monkeypatch, tmp_path):
    pytest.importorskip("mkdocs")
    hook = load_hook("explorer")
    monkeypatch.setenv("TWINSHARD_EXPLORER_CACHE", str(tmp_path))
    bad = Setting("optimized", 4, False, 2, "bf16")

    def fails(settings):
        raise RecordingFailed(f"the explorer failed to record {bad.label}")

    monkeypatch.setattr(explore, "record_grid", fails)
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match=re.escape(bad.label)):
        hook.on_files([], {"site_dir": str(tmp_path), "use_directory_urls": True})
    assert not list(tmp_path.glob("*.json")), "a failed recording left a cached file"


# --- the page: local files only, and what a browser shows --------------------------------------
def test_the_page_gets_its_data_and_refers_to_local_files_only(data, monkeypatch, tmp_path):
    pytest.importorskip("mkdocs")
    import markdown
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.utils.meta import get_data

    hook = load_hook("explorer")
    monkeypatch.setenv("TWINSHARD_EXPLORER_CACHE", str(tmp_path))
    (tmp_path / f"{hook.cache_key(AXES)}.json").write_text(json.dumps(data))  # a cached build
    assert json.loads(hook.explorer_json(AXES)) == data
    monkeypatch.setattr(explore, "AXES", AXES)  # the hook's default grid is this module's
    # the hook as mkdocs runs it: loaded from the config's hooks, its events dispatched
    config = MkDocsConfig()
    site = {"site_name": "t", "docs_dir": str(ROOT / "docs"), "site_dir": str(tmp_path / "site")}
    config.load_dict({**site, "hooks": [str(ROOT / "docs" / "hooks" / "explorer.py")]})
    assert config.validate() == ([], [])
    files = config.plugins.on_files(Files([]), config=config)
    served = files.get_file_from_path(hook.DATA)
    assert json.loads(served.content_string) == data
    body, _ = get_data((ROOT / "docs" / "explorer.md").read_text(encoding="utf-8"))
    rendered = markdown.markdown(body, extensions=["md_in_html", "attr_list"])
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri=hook.PAGE), url="explorer/")
    out = config.plugins.on_page_content(rendered, page=page, config=config, files=files)
    (src,) = re.findall(r'<div class="ts-explorer" data-src="([^"]+)">', out)
    assert urllib.parse.urljoin("/explorer/", src) == "/" + served.url
    # the page, its script and its style name no other site: no outside script or stylesheet
    site_config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for asset in ("js/explorer.js", "js/explorer_draw.js", "css/explorer.css"):
        assert re.search(rf"^\s+- {re.escape(asset)}$", site_config, re.M), asset
        assert (ROOT / "docs" / asset).is_file(), asset
    texts = {"page": out, "js": (ROOT / "docs/js/explorer.js").read_text(encoding="utf-8")}
    texts["draw"] = (ROOT / "docs/js/explorer_draw.js").read_text(encoding="utf-8")
    texts["css"] = (ROOT / "docs/css/explorer.css").read_text(encoding="utf-8")
    for name, text in texts.items():
        assert not re.findall(r"(?:https?:)?//[\w.-]+\.\w+/", text), name
        assert not re.findall(r"<script[^>]+src=|<link[^>]+href=|@import|url\(", text), name
    assert "fetch(src)" in texts["js"] and "data-src" not in hook.PLACE


def test_the_check_for_outside_sources_can_fail():
    outside = '<script src="https://cdn.example.org/d3.js"></script><link href="//x.io/a.css">'
    assert re.findall(r"(?:https?:)?//[\w.-]+\.\w+/", outside)


PROBE = ROOT / "tests" / "support" / "explorer_probe.html"


@pytest.mark.parametrize("width", [420, 1400])
def test_the_page_draws_steps_and_fits_in_a_browser(
    site, site_data, server, browser, width, tmp_path
):
    built = (site / "explorer" / "index.html").read_text(encoding="utf-8")
    scripts = re.findall(r'<script[^>]+src="([^"]+)"', built)
    assert scripts.index("../js/explorer_draw.js") < scripts.index("../js/explorer.js"), scripts
    assert '<link rel="stylesheet" href="../css/explorer.css"' in built
    assert not [s for s in scripts if re.match(r"(?:https?:)?//", s)], scripts
    page_probe = PROBE.read_text(encoding="utf-8")
    seen = probe(
        site, server, tmp_path, "_explorer_probe.html", page_probe, "/explorer/", width, 30000
    )
    assert seen["where"].startswith("event 1 of ")  # the arrow key moved the cursor
    assert seen["panels"] == seen["events"] == 2 and "peak unsharded" in seen["totals"]
    assert seen["smallest_font"] >= 11
    assert seen["page_width"] <= seen["frame_width"], "the page is wider than the window"
    # the legend: what the recordings hold, no more
    assert seen["legend_states"] == site_data["states"] and seen["legend_ops"] == site_data["ops"]
    # every control shows something, or is disabled and says why (the reference's prefetch)
    assert not seen["walked"]["problems"], seen["walked"]["problems"]
    assert "reference: Prefetch two ahead" in seen["walked"]["disabled"], seen["walked"]
    # 2 -> 4 ranks: this rank's shards and what it sends change, for every implementation
    for impl, (two, four) in seen["ranks"].items():
        for what in ("sent", "shards", "memline", "event_sent"):
            assert two[what] != four[what], (impl, what, two[what])
    # stepping with the stepper at the top of the window keeps the event's details under it
    step = seen["step"]
    assert step["head"].startswith("#3 "), step
    assert 0 <= step["gap"] < 60 and step["head_bottom"] <= step["height"], step
