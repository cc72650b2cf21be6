"""Tables, ratios, plots and the generated docs page of the comparison.

:func:`tables` returns the tables as plain text for the terminal; :func:`write_docs` writes
``docs/comparison.md`` and the PNG plots under ``docs/_static/comparison/``, both from the
results dict that :mod:`benchmarks.compare` builds (also saved as ``results.json`` beside the
plots, so the page can be regenerated with ``--report-only``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.features import COLUMNS as FEATURE_COLUMNS
from benchmarks.features import ROWS as FEATURES
from benchmarks.features import SOURCES as FEATURE_SOURCES

LABELS = {
    "driftsafe": "celery_driftsafe",
    "django-celery-beat": "django-celery-beat",
    "redbeat": "RedBeat",
}
COLOURS = {"driftsafe": "#1b7837", "django-celery-beat": "#2166ac", "redbeat": "#b2182b"}
ORDER = ("driftsafe", "django-celery-beat", "redbeat")
STATIC = Path("_static/comparison")


# -- formatting -------------------------------------------------------------------------------


def _num(value: Any, digits: int = 2, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and abs(value) >= 100:
        digits = 0
    return f"{value:,.{digits}f}{unit}"


def _count(value: Any) -> str:
    return "-" if value is None else f"{value:,}"


def _table(header: Sequence[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), *(fmt.format(*r) for r in rows)])


def _label(key: str) -> str:
    return LABELS.get(key, key)


def _sorted(rows: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (ORDER.index(r["peer"]), *(r.get(k) or 0 for k in keys)))


def _times(ours: float | None, theirs: float | None) -> str:
    """'N.Nx lower' / 'N.Nx higher': ours against theirs."""
    if not ours or not theirs or any(math.isnan(v) for v in (ours, theirs)):
        return "-"
    factor = max(ours, theirs) / min(ours, theirs)
    number = f"{factor:,.1f}x" if factor < 100 else f"{factor:,.0f}x"
    return f"{number} {'lower' if ours < theirs else 'higher'}"


# -- the tables -------------------------------------------------------------------------------


def skew_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "beats (offsets s)",
        "due slots",
        "slots sent",
        "duplicates",
        "missed",
        "sent early",
    ]
    rows = []
    for r in _sorted(results.get("skew", []), "beats"):
        offsets = ", ".join(f"{o:+.1f}" for o in r["offsets"])
        rows.append(
            [
                _label(r["peer"]),
                f"{r['beats']} ({offsets})",
                _count(r["due"]),
                _count(r["fired"]),
                _count(r["duplicates"]),
                _count(r["missed"]),
                _count(r["early"]),
            ]
        )
    return header, rows


def timing_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "beats",
        "early p50",
        "early p99",
        "early max",
        "late p50",
        "late p99",
        "late max",
        "beats that published",
    ]
    rows = []
    for r in _sorted(results.get("skew", []), "beats"):
        publishers = ", ".join(f"{o:+.1f}" for o in r["publishing_beats"]) or "none"
        rows.append(
            [_label(r["peer"]), str(r["beats"])]
            + [
                _num(r[k], 3, " s") if r["early"] or not k.startswith("early") else "none"
                for k in ("early_p50", "early_p99", "early_max")
            ]
            + [_num(r[k], 3, " s") for k in ("late_p50", "late_p99", "late_max")]
            + [publishers]
        )
    return header, rows


def failover_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "settings",
        "killed beat",
        "kill → next firing",
        "normal spacing p99",
        "slots lost (due after kill)",
        "worst first message after kill",
        "duplicates before / after",
    ]
    rows = []
    for r in _sorted(results.get("failover", []), "tuned"):
        gap = (
            _num(r["gap"], 2, " s")
            if r["gap"] is not None
            else f"none in {r['after']:.0f} s (bound)"
        )
        settings = "tuned" if r["tuned"] else "as shipped"
        if r.get("lock_ttl_at_kill"):
            settings += f"; lock TTL at kill {r['lock_ttl_at_kill']:.0f} s"
        rows.append(
            [
                _label(r["peer"]),
                settings,
                f"{r['victim_offset']:+.1f} s",
                gap,
                _num(r["normal_spacing_p99"], 2, " s"),
                f"{r['lost']:,} ({r['due_after']:,})",
                _num(r["late_after_max"], 2, " s"),
                f"{r['duplicates_before']:,} / {r['duplicates_after']:,}",
            ]
        )
    return header, rows


def _finished(r: dict[str, Any]) -> bool:
    return r["sent_fraction"] >= 0.99 and r["alive_at_end"]


def _late(r: dict[str, Any], key: str) -> str:
    text = _num(r[key], 3, " s")
    return f">= {text}" if r.get(f"{key}_at_least") else text


def scale_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "entries (due/s)",
        "start-up",
        "due slots sent in window",
        "sustained sends/s",
        "longest pause",
        "lateness p50",
        "lateness p99",
        "beat CPU",
        "beat RSS",
        "DB xacts/s",
        "DB rows read/s",
        "store cmds/s",
    ]
    rows = []
    for r in _sorted(results.get("scale", []), "tasks"):
        sent = f"{100 * r['sent_fraction']:.1f}% of {r['due']:,}"
        if not _finished(r):
            sent = f"**did not finish**: {sent} in {r['seconds']:.0f} s"
        startup = (
            _num(r["startup"], 2, " s")
            if r["startup"] is not None
            else f"> {r['seconds']:.0f} s (bound)"
        )
        beats = f", {r['beats']} beats" if r.get("beats", 1) > 1 else ""
        rows.append(
            [
                _label(r["peer"]),
                f"{r['tasks']:,} ({r['due_rate']:,.0f}){beats}",
                startup,
                sent,
                _num(r["sustained"], 0),
                _num(r.get("longest_pause"), 2, " s"),
                _late(r, "late_p50"),
                _late(r, "late_p99"),
                _num(r["cpu_percent"], 0, "%"),
                _num(r["rss_mb"], 0, " MB"),
                _num(r["db_xacts_per_s"], 0),
                _num(r["db_rows_read_per_s"], 0),
                _num(r["store_commands_per_s"], 0),
            ]
        )
    return header, rows


def edit_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "edits",
        "edit → first firing p50",
        "edit → first firing max",
        "first firing vs due, max",
        "last beat to fire it, max",
        "never fired",
    ]
    rows = []
    for r in _sorted(results.get("edits", [])):
        all_beats = (
            _num(r["all_beats_max"], 2, " s")
            if r["peer"] == "django-celery-beat"
            else (
                "n/a: claims read the database"
                if r["peer"] == "driftsafe"
                else "n/a: one active beat"
            )
        )
        rows.append(
            [
                _label(r["peer"]),
                str(r["count"]),
                _num(r["edit_to_first_p50"], 2, " s"),
                _num(r["edit_to_first_max"], 2, " s"),
                _num(r["first_late_max"], 2, " s"),
                all_beats,
                str(r["never_fired"]),
            ]
        )
    return header, rows


def burst_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "entries",
        "beats",
        "wave out after",
        "slots/s",
        "lateness p50",
        "lateness p99",
        "lateness max",
        "duplicates",
        "early",
        "not sent in bound",
        "recorded missed",
        "beat CPU s (µs/slot)",
        "beat RSS",
    ]
    rows = []
    for r in _sorted(results.get("burst", []), "tasks", "beats"):
        drain = (
            _num(r["drain"], 1, " s")
            if r["drain"] is not None
            else f"**> {r['bound']:.0f} s (bound)**"
        )
        cpu = f"{r['cpu_s']:.1f} ({_num(r['cpu_us_per_slot'], 0)})"
        rows.append(
            [
                _label(r["peer"]),
                f"{r['tasks']:,}",
                str(r["beats"]),
                drain,
                _num(r["rate"], 0),
                _late(r, "late_p50"),
                _late(r, "late_p99"),
                _late(r, "late_max"),
                _count(r["duplicates"]),
                _count(r["early"]),
                _count(r["unsent"]),
                "n/a: no ledger" if r["recorded_missed"] is None else _count(r["recorded_missed"]),
                cpu,
                _num(r["rss_mb"], 0, " MB"),
            ]
        )
    return header, rows


def recovery_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "scheduler",
        "entries",
        "outage",
        "first message",
        "every entry caught up",
        "catch-up messages",
        "ledger rows per entry",
        "missed slots recorded",
        "beat CPU s",
        "beat RSS",
    ]
    rows = []
    for r in _sorted(results.get("recovery", []), "tasks"):
        everyone = (
            _num(r["all_caught_up"], 1, " s")
            if r["all_caught_up"] is not None
            else f"> {r['bound']:.0f} s ({r['caught_up']:,} of {r['tasks']:,})"
        )
        rows.append(
            [
                _label(r["peer"]),
                f"{r['tasks']:,}",
                f"{r['outage_h']:g} h",
                _num(r["first_message"], 1, " s"),
                everyone,
                _count(r["catch_up_messages"]),
                _num(r["ledger_rows_per_task"], 2)
                if r["ledger_rows_per_task"] is not None
                else "n/a",
                _count(r["missed_slots"]),
                _num(r["cpu_s"], 1),
                _num(r["rss_mb"], 0, " MB"),
            ]
        )
    return header, rows


#: The page's sections: title, table, scenario and plot.
SECTIONS = (
    ("1. Duplicates and misses with K skewed beats", skew_rows, "skew", "skew.png"),
    (
        "2. Dispatch timing against true time (all messages, same runs)",
        timing_rows,
        "skew",
        "timing.png",
    ),
    (
        "3. Failover: SIGKILL the beat that published last",
        failover_rows,
        "failover",
        "failover.png",
    ),
    ("4. Scale on PostgreSQL: one beat, every entry every 60 s", scale_rows, "scale", "scale.png"),
    ("5. Schedule edit propagation (3 skewed beats)", edit_rows, "edits", "edits.png"),
    ("6. A burst: every entry due at one instant", burst_rows, "burst", "burst.png"),
    ("7. Recovery after an outage with no beat running", recovery_rows, "recovery", None),
)
SCENARIO_OF: dict[str, str] = {title: scenario for title, _, scenario, _ in SECTIONS}


def tables(results: dict[str, Any]) -> str:
    out = []
    for title, build, _, _ in SECTIONS:
        header, rows = build(results)
        if rows:
            out.append(f"\n== {title}\n{_table(header, rows, markdown=False)}")
    return "\n".join(out)


# -- ratios -----------------------------------------------------------------------------------


def ratios(results: dict[str, Any]) -> list[str]:
    """One sentence per comparison worth quoting, ours against each peer."""
    lines = []
    scale = results.get("scale", [])
    for tasks in sorted({r["tasks"] for r in scale}):
        by = {r["peer"]: r for r in scale if r["tasks"] == tasks}
        ours = by.get("driftsafe")
        if not ours:
            continue
        for key in ("django-celery-beat", "redbeat"):
            peer = by.get(key)
            if not peer:
                continue
            clauses = [
                f"share of due slots sent {_times(ours['sent_fraction'], peer['sent_fraction'])} "
                f"({100 * ours['sent_fraction']:.1f}% against {100 * peer['sent_fraction']:.1f}%)",
            ]
            if peer["sustained"] >= 1:
                clauses.append(
                    f"sustained sends/s {_times(ours['sustained'], peer['sustained'])} "
                    f"({ours['sustained']:,.0f} against {peer['sustained']:,.0f})"
                )
            else:
                clauses.append(
                    f"{ours['sustained']:,.0f} sends/s sustained against {peer['sustained']:.1f}"
                )
            if not ours.get("late_p99_at_least") and ours["late_p99"] > 0:
                bound = ">= " if peer.get("late_p99_at_least") else ""
                clauses.append(
                    f"p99 lateness {bound}{_times(ours['late_p99'], peer['late_p99'])} "
                    f"({ours['late_p99']:.3f} s against {bound}{_num(peer['late_p99'], 3)} s)"
                )
            if ours["startup"] and peer["startup"]:
                clauses.append(
                    f"start-up {_times(ours['startup'], peer['startup'])} "
                    f"({ours['startup']:.2f} s against {peer['startup']:.2f} s)"
                )
            clauses.append(
                f"RSS {_times(ours['rss_mb'], peer['rss_mb'])} "
                f"({ours['rss_mb']:.0f} MB against {peer['rss_mb']:.0f} MB)"
            )
            if peer["sustained"] >= 1 and ours["sustained"] >= 1:
                ours_cost = ours["cpu_percent"] / ours["sustained"]
                peer_cost = peer["cpu_percent"] / peer["sustained"]
                clauses.append(f"CPU per message sent {_times(ours_cost, peer_cost)}")
            lines.append(
                f"{tasks:,} entries, celery_driftsafe against {_label(key)}: "
                + "; ".join(clauses)
                + "."
            )
    for tasks in sorted({r["tasks"] for r in results.get("burst", [])}):
        by = {(r["peer"], r["beats"]): r for r in results["burst"] if r["tasks"] == tasks}
        ours = by.get(("driftsafe", 1))
        if not ours or ours["drain"] is None:
            continue
        for key in ("django-celery-beat", "redbeat"):
            peer = by.get((key, 1))
            if not peer:
                continue
            out = (
                f"after {peer['drain']:.1f} s"
                if peer["drain"] is not None
                else f"not within {peer['bound']:.0f} s ({peer['sent']:,} sent)"
            )
            lines.append(
                f"A burst of {tasks:,} entries due at one instant, one beat each: "
                f"celery_driftsafe's wave was out after {ours['drain']:.1f} s, "
                f"{_label(key)}'s {out}; beat CPU per slot sent "
                f"{_times(ours['cpu_us_per_slot'], peer['cpu_us_per_slot'])}."
            )
    failover = {(r["peer"], r["tuned"]): r for r in results.get("failover", [])}
    ours = failover.get(("driftsafe", False))
    if ours and ours["gap"] is not None:
        for (key, tuned), r in sorted(failover.items()):
            if key == "driftsafe":
                continue
            gap = f"{r['gap']:.2f} s" if r["gap"] is not None else f"more than {r['after']:.0f} s"
            dup = (
                f"; it sent {r['duplicates_after']:,} duplicates after the kill"
                if r["duplicates_after"]
                else ""
            )
            lines.append(
                f"Failover, {_label(key)} {'tuned' if tuned else 'as shipped'}: next firing "
                f"after {gap} against {ours['gap']:.2f} s for celery_driftsafe; "
                f"{r['lost']:,} slots lost against {ours['lost']:,}{dup}."
            )
    skew = {(r["peer"], r["beats"]): r for r in results.get("skew", [])}
    for (key, beats), r in sorted(skew.items()):
        ours = skew.get(("driftsafe", beats))
        if key == "driftsafe" or not ours or beats < 2:
            continue
        lines.append(
            f"{beats} skewed beats, {_label(key)}: {r['duplicates']:,} duplicates, "
            f"{r['missed']:,} missed and {r['early']:,} early messages for {r['due']:,} due "
            f"slots (earliest {r['early_max']:.2f} s before its slot); celery_driftsafe: "
            f"{ours['duplicates']:,}, {ours['missed']:,} and {ours['early']:,}."
        )
    return lines


# -- plots ------------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def plot_skew(results: dict[str, Any], path: Path) -> bool:
    rows = results.get("skew", [])
    if not rows:
        return False
    plt = _plt()
    ks = sorted({r["beats"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    width = 0.8 / len(ORDER)
    for j, (field, title) in enumerate(
        (
            ("duplicates", "duplicate messages per due slot"),
            ("missed", "missed slots per due slot"),
            ("early", "messages sent early per due slot"),
        )
    ):
        ax = axes[j]
        for i, key in enumerate(ORDER):
            values = []
            for k in ks:
                r = next((r for r in rows if r["peer"] == key and r["beats"] == k), None)
                values.append(r[field] / r["due"] if r and r["due"] else 0.0)
            bars = ax.bar(
                [k + (i - 1) * width for k in ks],
                values,
                width,
                label=_label(key),
                color=COLOURS[key],
            )
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
        ax.set_xticks(ks)
        ax.set_xlabel("beats (K)")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_timing(results: dict[str, Any], path: Path) -> bool:
    rows = [r for r in results.get("skew", []) if r["sample"]]
    if not rows:
        return False
    plt = _plt()
    k = max(r["beats"] for r in rows)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    bins = [x / 20 for x in range(-20, 41)]  # -1 .. +2 s in 50 ms bins
    offsets = next(r["offsets"] for r in rows if r["beats"] == k)
    for key in ORDER:
        r = next((r for r in rows if r["peer"] == key and r["beats"] == k), None)
        if r is None:
            continue
        sample = [min(max(x, -0.999), 1.999) for x in r["sample"]]
        ax.hist(
            sample,
            bins=bins,
            histtype="step",
            linewidth=1.6,
            color=COLOURS[key],
            label=f"{_label(key)} ({len(sample):,} messages)",
        )
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("message arrival - due instant, true time (s); left of 0 = early")
    ax.set_ylabel("messages")
    ax.set_title(
        f"Dispatch timing, {k} beats skewed " + ", ".join(f"{o:+.1f}" for o in offsets) + " s"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_failover(results: dict[str, Any], path: Path) -> bool:
    rows = _sorted(results.get("failover", []), "tuned")
    if not rows:
        return False
    plt = _plt()
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.5 * len(rows) + 0.6), sharex=True)
    axes = axes if len(rows) > 1 else [axes]
    for ax, r in zip(axes, rows, strict=True):
        stamps = r["timeline"]
        lo, hi = -r["before"] + 2, r["after"]
        bins = [lo + 0.5 * i for i in range(int((hi - lo) / 0.5) + 1)]
        ax.hist([s for s in stamps if lo <= s <= hi], bins=bins, color=COLOURS[r["peer"]])
        ax.axvline(0, color="black", linewidth=1)
        ax.set_ylabel("msgs / 0.5 s", fontsize=7)
        ax.set_title(
            f"{_label(r['peer'])}, {'tuned' if r['tuned'] else 'as shipped'}",
            fontsize=8,
            loc="left",
        )
    axes[-1].set_xlabel("seconds from SIGKILL of the publishing beat (due: 10 slots/s)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_scale(results: dict[str, Any], path: Path) -> bool:
    rows = results.get("scale", [])
    if not rows:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
    sizes = sorted({r["tasks"] for r in rows})
    panels = (
        ("sustained", "sustained sends/s", True),
        ("late_p99", "p99 lateness (s)", True),
        ("cpu_percent", "beat CPU (% of one core)", False),
        ("rss_mb", "beat RSS (MB)", False),
    )
    for ax, (field, title, log) in zip(axes, panels, strict=True):
        for key in ORDER:
            points = [
                (r["tasks"], r[field])
                for r in sorted(rows, key=lambda r: r["tasks"])
                if r["peer"] == key
                and r[field] is not None
                and not (isinstance(r[field], float) and math.isnan(r[field]))
            ]
            if points:
                ax.plot(
                    *zip(*points, strict=True), marker="o", color=COLOURS[key], label=_label(key)
                )
        if field == "sustained":
            ax.plot(sizes, [s / 60 for s in sizes], linestyle="--", color="grey", label="due rate")
        ax.set_xscale("log")
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("enabled entries")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_edits(results: dict[str, Any], path: Path) -> bool:
    rows = _sorted(results.get("edits", []))
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    for i, r in enumerate(rows):
        delays = [d for d in r["delays"] if d is not None]
        ax.scatter([d for d in delays], [i] * len(delays), color=COLOURS[r["peer"]], s=30)
    ax.set_yticks(range(len(rows)), [_label(r["peer"]) for r in rows])
    ax.set_xlabel("first firing after the edit - its due instant (s)")
    ax.set_title("Schedule edit → first firing under the new schedule")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_burst(results: dict[str, Any], path: Path) -> bool:
    rows = [r for r in _sorted(results.get("burst", []), "tasks", "beats") if r.get("curve")]
    if not rows:
        return False
    plt = _plt()
    tasks = max(r["tasks"] for r in rows)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    styles = {1: "-", 2: "-.", 3: "--"}
    for r in rows:
        if r["tasks"] != tasks:
            continue
        xs = [0.0] + [x for x, _ in r["curve"]]
        ys = [0] + [y for _, y in r["curve"]]
        ax.step(
            xs,
            ys,
            where="post",
            color=COLOURS[r["peer"]],
            linestyle=styles.get(r["beats"], ":"),
            linewidth=1.6,
            label=f"{_label(r['peer'])}, {r['beats']} beat{'s' if r['beats'] > 1 else ''}",
        )
    ax.axhline(tasks, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("seconds after the instant every entry was due (true time)")
    ax.set_ylabel("entries sent")
    ax.set_title(f"A burst: {tasks:,} entries due at one instant")
    ax.set_xlim(left=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


PLOTS = (
    ("skew.png", plot_skew, "Duplicates, misses and early sends per due slot, K = 1, 2, 3"),
    ("timing.png", plot_timing, "Dispatch timing against true time"),
    ("failover.png", plot_failover, "Messages per 0.5 s around the SIGKILL"),
    ("scale.png", plot_scale, "Scale on PostgreSQL"),
    ("edits.png", plot_edits, "Schedule edit propagation"),
    ("burst.png", plot_burst, "Entries sent against seconds after the burst's instant"),
)


# -- the page ---------------------------------------------------------------------------------


def _burst_size(results: dict[str, Any]) -> str:
    """The burst's size and the machine's load, said beside its table."""
    meta = results["meta"]
    sizes = sorted({r["tasks"] for r in results.get("burst", [])})
    if not sizes:
        return ""
    text = f" Size: {', '.join(f'{n:,}' for n in sizes)} entries"
    if max(sizes) < 100_000:
        text += (
            " (the issue's 100,000 take a run of their own on a quiet machine; this "
            "one had to fit in about ten minutes of a shared one)"
        )
    load = meta.get("load", {}).get("burst")
    if load:
        text += (
            f". 1-minute load average during the burst runs: {load[0]:.2f} to "
            f"{load[1]:.2f} on {meta['machine']['cores']} cores"
        )
    uptime = meta.get("burst", {}).get("uptime")
    if uptime:
        text += f"; `uptime` load averages (1, 5, 15 min) as the run ended: {uptime}"
    return text + "."


def _section_text(results: dict[str, Any]) -> dict[str, str]:
    meta = results["meta"]
    burst = meta.get("burst", {})
    recovery = meta.get("recovery", {})
    return {
        SECTIONS[0][0]: (
            f"{meta['skew']['entries']} interval entries (every 4, 5 or 6 s), "
            f"{meta['skew']['seconds']:.0f} s of due slots, K beats started in this order "
            "with wall clocks skewed by libfaketime: "
            + ", ".join(f"{o:+.1f} s" for o in meta["offsets"])
            + ". A message counts for its entry's nearest due instant; a second message for the "
            "same instant is a duplicate; an instant with none is missed."
        ),
        SECTIONS[1][0]: (
            "Signed arrival time of every message against its due instant, measured with the "
            "benchmark's own (unskewed) clock, which is the servers' clock. Early = sent before "
            "the slot was due. RedBeat's timing is that of whichever beat holds its lock: here "
            "the first one started, whose clock is 0.7 s fast."
        ),
        SECTIONS[2][0]: (
            f"Three skewed beats, 40 entries every 4 s (a due slot every 0.1 s). After "
            f"{meta['failover']['before']:.0f} s the beat that published the latest message is "
            f"killed with SIGKILL, then {meta['failover']['after']:.0f} s are watched (the "
            "bound). Slots lost = slots due after the kill (to 3 s before the bound) that got "
            "no message within the bound."
        ),
        SECTIONS[3][0]: (
            "N entries every 60 s, first due instants spread evenly over the minute that "
            "starts at launch, so N/60 slots fall due every second from the first second. One "
            "beat, no skew, a bounded window per size ("
            + ", ".join(f"{int(t):,}: {s:.0f} s" for t, s in meta["scale"]["windows"].items())
            + f"). Start-up = launch to first message. Lateness and sustained sends/s count "
            f"slots due from {meta['scale']['settle']:.0f} s after launch (messages matched in "
            "order per entry); a slot still unsent at the end of the window counts as at least "
            "(end - due) late, and a percentile that depends on such slots is shown as >=. "
            "Longest pause = the longest stretch without a single message, from the first "
            "message to the end of the window. CPU and RSS of the beat process from /proc (CPU "
            "over the whole window, 100% = one core). DB columns are deltas of "
            "pg_stat_database for the "
            "trial's own database over the window (transactions, rows read, rows written); "
            "store cmds/s counts commands on the run's own redis-server (RedBeat's schedule, "
            "celery_driftsafe's locks and wake-ups; the broker is elsewhere). A run that did "
            "not send 99% of its due slots within its window is marked **did not finish**."
        ),
        SECTIONS[5][0]: (
            "N entries every 60 s whose first due instant is one and the same (what N tenants' "
            "`* * * * *` or `0 0 * * *` crontabs look like), the beats started and idle "
            "before it. celery_driftsafe runs with 1 and 3 beats; the peers with one "
            "(django-celery-beat's beats do not coordinate, so K beats would send K copies; "
            "RedBeat has one active beat). Every message is recorded on arrival; the wave is "
            f"watched until every entry has sent or {burst.get('bound', 55):.0f} s after the "
            "instant (before the next wave is due). Lateness = first message of an entry - "
            "the instant; an entry not sent within the bound counts as at least the bound "
            "late (>=). Wave out after = the last entry's lateness; slots/s = entries / that. "
            "Duplicates = messages beyond the first per entry; early = before the instant; "
            "recorded missed = slots celery_driftsafe's ledger marked missed (the peers keep "
            "no ledger). Beat CPU is summed over the beats from just before the instant; "
            "CPU µs a slot is the figure to compare on a loaded machine." + _burst_size(results)
        ),
        SECTIONS[6][0]: (
            f"N entries every 60 s, due for the last {recovery.get('outage_hours', 24):g} h "
            "(first due instants spread over that minute) with no beat running; then one beat "
            "starts. First message and every entry caught up: seconds from the beat's launch "
            "to the first message and to the moment every entry had sent at least one "
            f"(bound {recovery.get('bound', 180):.0f} s). Ledger rows per entry and missed "
            "slots recorded: celery_driftsafe's ledger for slots before the restart."
        ),
        SECTIONS[4][0]: (
            f"Three skewed beats and 20 background entries every 60 s. {meta['edits']['count']} "
            "idle entries (every 3600 s) are edited, one every "
            f"{meta['edits']['spacing']:.0f} s, to run every 1 s, the documented way for each "
            "scheduler (ORM save for the two Django schedulers, entry save for RedBeat). "
            "django-celery-beat and RedBeat treat the edited entry as overdue at once; "
            "celery_driftsafe keeps its interval anchor, so its first slot is the next 1 s "
            "grid point after the edit. 'First firing vs due' subtracts that instant (the edit "
            "itself for the peers); 'last beat' is when every django-celery-beat beat has sent "
            "it."
        ),
    }


def _machine(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        f"- CPU: {m['cpu']} x {m['cores']} cores; memory {m['memory']}",
        f"- {m['os']}; Python {m['python']}; {m['postgres']}; Redis {m['redis']}",
        "- Packages: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- Run: {meta['started']} to {meta['finished']} ({meta['duration_min']:.0f} min), "
        f"command `{meta['command']}`",
    ]
    for rerun in meta.get("rerun", []):
        verb = "Added" if rerun.get("added") else "Re-measured"
        lines.append(
            f"- {verb} in a later run: {', '.join(rerun['scenarios'])}"
            f" ({rerun['started']} to {rerun['finished']}, every scheduler, "
            f"`{rerun['command']}`)"
        )
    return "\n".join(lines)


def _load(meta: dict[str, Any]) -> str:
    rows = [[name, f"{lo:.2f}", f"{hi:.2f}"] for name, (lo, hi) in meta["load"].items()]
    text = _table(["scenario", "1-min load average, lowest", "highest"], rows, markdown=True)
    busy = max((hi for _, hi in meta["load"].values()), default=0.0)
    note = (
        "The machine was shared: other test runs were going on during this benchmark "
        f"(1-minute load average up to {busy:.2f} on 2 cores, the benchmark's own processes "
        "included). Absolute numbers would be better on an idle machine; every scheduler ran "
        "under the same conditions, one after the other, in the same run."
        if busy > 1.5
        else "The machine was otherwise quiet during the run (the load above is mostly the "
        "benchmark's own processes)."
    )
    return f"{text}\n\n{note}"


def _flips(now: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[str]:
    """Scale runs that finished in one measurement and not in the other."""
    then = {(r["peer"], r["tasks"]): r for r in before}
    lines = []
    for r in _sorted(now, "tasks"):
        old = then.get((r["peer"], r["tasks"]))
        if old and _finished(old) != _finished(r):
            kept, lost = (r, old) if _finished(r) else (old, r)
            lines.append(
                f"- {_label(r['peer'])} at {r['tasks']:,} entries kept up in one measurement "
                f"(p99 lateness {_late(kept, 'late_p99')}, CPU {kept['cpu_percent']:.0f}%) and "
                f"fell behind in the other ({100 * lost['sent_fraction']:.1f}% sent, CPU "
                f"{lost['cpu_percent']:.0f}%"
                + (
                    f", longest pause {lost['longest_pause']:.1f} s"
                    if lost.get("longest_pause") is not None
                    else ""
                )
                + "): its result at this size depends on the run."
            )
    return lines


def features() -> str:
    """The "Features" section: :mod:`benchmarks.features` as a table, with its sources."""
    header = ["feature", *(title for _, title in FEATURE_COLUMNS)]
    rows = [[feature, *(cells[key] for key, _ in FEATURE_COLUMNS)] for feature, cells in FEATURES]
    sources = [f"{n}. <{url}>" for n, url in enumerate(FEATURE_SOURCES, start=1)]
    return "\n".join(
        [
            "## Features",
            "",
            "What each scheduler offers, from its own documentation (*measured below* points "
            "at the tables of this page, the rest is not measured). Temporal schedules and "
            "Kubernetes CronJob are not Celery schedulers and are not measured here; they are "
            "in the table for their policies. Celery beat is Celery's own scheduler as shipped "
            "(`PersistentScheduler`, one beat), which the measured peers replace. [n] is a "
            "source listed under the table.",
            "",
            _table(header, rows, markdown=True),
            "",
            "Sources:",
            "",
            *sources,
            "",
        ]
    )


def write_docs(results: dict[str, Any], docs: Path, *, plot: bool = True) -> Path:
    """Write ``docs/comparison.md`` from ``results``, and its plots; with ``plot=False`` the
    page links the plots already under ``docs/_static/comparison/`` and draws none (a page
    rendered again from a saved results.json, without matplotlib)."""
    static = docs / STATIC
    static.mkdir(parents=True, exist_ok=True)
    images = {}
    for name, draw, caption in PLOTS:
        if draw(results, static / name) if plot else (static / name).exists():
            images[name] = caption
    page = docs / "comparison.md"
    page.write_text(render_page(results, images))
    return page


def render_page(results: dict[str, Any], images: dict[str, str]) -> str:
    """The page's text: ``images`` maps the plot files to link to their captions."""
    meta = results["meta"]
    text = _section_text(results)
    parts = [
        "# Comparison with django-celery-beat and RedBeat",
        "",
        "<!-- Generated by `python -m benchmarks compare`; edits by hand are overwritten. -->",
        "",
        "Three schedulers, measured one after another in one run on the same machine, with the "
        "same schedules, the same PostgreSQL and Redis servers and the same recorder: "
        "celery_driftsafe's `DriftSafeScheduler`, django-celery-beat's `DatabaseScheduler` "
        "and RedBeat's `RedBeatScheduler`. The peers run as shipped (their documented "
        "defaults) unless a row says *tuned*.",
        "",
    ]
    if meta.get("quick"):
        parts += [
            "```{note}",
            "This page was generated by a `--quick` smoke run (small sizes, "
            "short windows): its numbers show that the command works, not how the "
            "schedulers compare.",
            "```",
            "",
        ]
    parts += [
        features(),
        "## Reproduce",
        "",
        "```",
        "bash benchmarks/compare.sh            # the published run",
        "```",
        "",
        "It creates `.venv-bench`, installs this package, django-celery-beat, celery-redbeat "
        "and matplotlib into it, then runs `python -m benchmarks compare` "
        "(`benchmarks/compare.py`), which prints the tables and rewrites this page and its "
        "plots (about 45 minutes on this machine). "
        "`bash benchmarks/compare.sh --quick` runs every scenario at small sizes in a few "
        "minutes and leaves this page alone; `--help` lists the knobs; `--scenarios burst "
        "--merge docs/_static/comparison/results.json` re-measures one scenario (every "
        "scheduler again) into the saved results. Needs PostgreSQL, "
        "Redis (`redis-server` for the run's own broker and store) and libfaketime (Debian "
        "package `faketime`).",
        "",
        "## Machine",
        "",
        _machine(meta),
        "",
        "## How each scheduler was run",
        "",
    ]
    for key in ORDER:
        note = meta["peers"].get(key)
        if note:
            parts.append(
                f"- **{_label(key)}**: {note['shipped']}"
                + (f"; *tuned*: {note['tuned']}" if note["tuned"] else "")
            )
    parts += [
        "",
        "Every beat is a real `celery beat` process of one Celery app configured from Django "
        "settings (`benchmarks/bench_settings.py`; Django's default `CONN_MAX_AGE = 0` for "
        "both database schedulers). Every message is popped off the broker as it arrives "
        "and stamped with the benchmark's clock. The peers put no slot identity in their "
        "messages, so messages are matched to due instants by entry and time, the same way "
        "for all three; celery_driftsafe's slot header is only used as a cross-check "
        f"(mismatches found: {meta['slot_mismatches']}).",
        "",
    ]
    lines = ratios(results)
    if lines:
        parts += ["## Ratios", "", *[f"- {line}" for line in lines], ""]
    for title, build, _, image in SECTIONS:
        header, rows = build(results)
        if not rows:
            continue
        parts += [f"## {title}", "", text[title], "", _table(header, rows, markdown=True), ""]
        if image in images:
            parts += [f"![{images[image]}]({STATIC / image})", ""]
        scenario = SCENARIO_OF[title]
        earlier = results.get("earlier", {}).get(scenario)
        if earlier:
            lo, hi = earlier["load"] or (float("nan"), float("nan"))
            header, rows = build({scenario: earlier["rows"]})
            parts += [
                f"The same scenario as first measured in the run of {earlier['started']} "
                f"(1-minute load average {lo:.2f} to {hi:.2f}); the table above is the "
                "re-measurement, with every scheduler again"
                + (
                    " (that run did not record the longest pause)"
                    if scenario == "scale"
                    and all("longest_pause" not in r for r in earlier["rows"])
                    else ""
                )
                + ":",
                "",
                _table(header, rows, markdown=True),
                "",
            ]
            if scenario == "scale":
                parts += [*_flips(results["scale"], earlier["rows"]), ""]
    parts += ["## What could not be measured", ""]
    parts += [f"- {item}" for item in meta["limits"]]
    parts += ["", "## Load during the run", "", _load(meta), ""]
    return "\n".join(parts)
