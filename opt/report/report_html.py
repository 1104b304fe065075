"""A self-contained HTML report of one optimization (no network needed to view it).

Sections: summary, op histogram before/after (inline SVG bars), time per pass and per rule,
parity per output, remarks with filters (kind, rule, text), and the bundle manifest when there is
one.  Every string that comes from the model is HTML-escaped; the remark data travels as JSON
inside a <script> block with ``</`` escaped.
"""

from __future__ import annotations

import html
import json
from typing import Any

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2430}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #dde}
.muted{color:#667} .ok{color:#137333;font-weight:600} .bad{color:#b3261e;font-weight:600}
table{border-collapse:collapse;margin:6px 0} td,th{padding:3px 10px;border-bottom:1px solid #eef}
th{text-align:left;background:#f5f6fa} td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:12px;flex-wrap:wrap} .card{border:1px solid #dde;border-radius:6px;
padding:8px 14px;min-width:120px} .card b{display:block;font-size:20px}
.bar-b{fill:#9aa6c1} .bar-a{fill:#3b6fd8} svg text{font-size:12px;fill:#1d2430}
.kind-passed{color:#137333} .kind-missed{color:#b26a00} .kind-failure{color:#b3261e}
.filters{display:flex;gap:8px;margin:6px 0} input,select{font:inherit;padding:2px 6px}
"""

_JS = """
const remarks = JSON.parse(document.getElementById('remark-data').textContent);
const body = document.getElementById('remarks-body');
const fk = document.getElementById('f-kind'), fr = document.getElementById('f-rule'),
      ft = document.getElementById('f-text');
function esc(s){return String(s).replace(/[&<>"']/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;',
  '"':'&quot;',"'":'&#39;'}[c]));}
function render(){
  const k = fk.value, r = fr.value, t = ft.value.toLowerCase();
  const rows = remarks.filter(x => (!k || x.kind === k) && (!r || x.rule === r) &&
    (!t || JSON.stringify(x).toLowerCase().includes(t)));
  body.innerHTML = rows.map(x => '<tr><td class="kind-' + esc(x.kind) + '">' + esc(x.kind) +
    '</td><td>' + esc(x.rule) + '</td><td>' + esc(x.code) + '</td><td>' +
    esc((x.nodes || []).join(', ')) + '</td><td>' + esc(x.message) + '</td></tr>').join('');
  document.getElementById('remarks-count').textContent = rows.length + ' of ' + remarks.length;
}
[fk, fr, ft].forEach(e => e.addEventListener('input', render));
render();
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(
    headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset(), table_id: str = ""
) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{_e(c)}</td>' if i in numeric else f"<td>{c}</td>"
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _histogram(before: dict[str, int], after: dict[str, int]) -> str:
    ops = sorted(
        set(before) | set(after), key=lambda o: (-max(before.get(o, 0), after.get(o, 0)), o)
    )[:40]
    peak = max([1] + [max(before.get(o, 0), after.get(o, 0)) for o in ops])
    width, label, row = 520, 190, 22
    parts = []
    for i, op in enumerate(ops):
        y = i * row
        b, a = before.get(op, 0), after.get(op, 0)
        wb, wa = width * b / peak, width * a / peak
        parts.append(
            f'<text x="{label - 6}" y="{y + 14}" text-anchor="end">{_e(op)}</text>'
            f'<rect class="bar-b" x="{label}" y="{y + 2}" width="{wb:.1f}" height="8"/>'
            f'<rect class="bar-a" x="{label}" y="{y + 11}" width="{wa:.1f}" height="8"/>'
            f'<text x="{label + max(wb, wa) + 6:.1f}" y="{y + 14}">{b} → {a}</text>'
        )
    h = max(row * len(ops), row)
    return (
        f'<svg id="op-histogram" role="img" aria-label="op histogram" width="{label + width + 90}"'
        f' height="{h}" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
        '<div class="muted">grey: before, blue: after (top 40 op types)</div>'
    )


def _pct(share: float) -> str:
    return f"{share * 100:.1f} %"


def _profile_section(prof: dict[str, Any] | None) -> str:
    """``optimize --profile``: the op-type account summed against the measured run (the
    residual shown), the mapping coverage, and the missed fusions ranked by measured time."""
    if not prof:
        return ""
    if not prof.get("ran", True):
        return f"<h2>Profile</h2><p class='muted'>not profiled: {_e(prof.get('why'))}</p>"
    acc = prof["account"]
    rows = [
        [_e(g["op"]), g["count"], f"{g['ms']:.3f}", f"{g['kernel_ms']:.3f}", _pct(g["share"])]
        for g in prof["ops"]
    ]
    rows += [[_e(o["row"]), "", f"{o['ms']:.3f}", "", _pct(o["share"])] for o in acc["other"]]
    rows.append(
        [
            "<b>sum of the rows</b>",
            prof["node_count"],
            f"{acc['rows_ms']:.3f}",
            f"{prof['kernel_ms']:.3f}",
            _pct(prof["ratio"] or 0.0),
        ]
    )
    rows.append(["residual", "", f"{acc['residual_ms']:+.3f}", "", _pct(acc["residual_share"])])
    rows.append(
        [
            f"<b>measured run</b> ({_e(acc['measured_by'])}, median)",
            "",
            f"{acc['measured_ms']:.3f}",
            "",
            "100.0 %",
        ]
    )
    missed = [
        [
            _pct(m["share"]),
            f"{m['ms']:.3f}",
            m["nodes"],
            f"<code>{_e(m['rule'])}</code>",
            f"<code>{_e(m['code'])}</code>",
            _e(m["message"]),
            _e(", ".join(m["sites"][:3])),
        ]
        for m in prof["missed"][:20]
    ]
    note = prof.get("providers_note")
    unprofiled = prof.get("unprofiled_run_ms")
    return (
        "<h2>Profile</h2>"
        f"<p>{prof['runs']} profiled runs of <code>{_e(prof['session'].get('model'))}</code> "
        f"({_e(prof['session'].get('level'))}); coverage <b>{_pct(prof['coverage'])}</b> of "
        f"the nodes' time attributed to the model's nodes; with the profiler off the run takes "
        f"{_e(unprofiled)} ms (the profiler's own cost: {_e(acc.get('profiler_ms'))} ms, "
        "inside the rows)</p>"
        + (f"<p class='bad'>{_e(note)}</p>" if note else "")
        + _table(["op", "count", "ms", "kernel ms", "share"], rows, {1, 2, 3, 4}, "profile-ops")
        + "<h3>Missed fusions by measured time</h3>"
        + (
            _table(
                ["share", "ms", "nodes", "rule", "code", "why", "at"],
                missed,
                {0, 1, 2},
                "profile-missed",
            )
            if missed
            else "<p class='muted'>no missed remark names a profiled node</p>"
        )
    )


def _compare_section(cmp: dict[str, Any] | None) -> str:
    """``profile --compare``: per op type, the original's and the optimized model's time with
    their intervals and the delta."""
    if not cmp:
        return ""

    def span(ms: float, iv: list[float]) -> str:
        return f"{ms:.3f} [{iv[0]:.3f}, {iv[1]:.3f}]"

    rows = [
        [
            _e(r["op"]),
            r["count_original"],
            r["count_optimized"],
            span(r["ms_original"], r["interval_original"]),
            span(r["ms_optimized"], r["interval_optimized"]),
            f"{r['delta_ms']:+.3f}",
        ]
        for r in cmp["ops"]
    ]
    head = ["op", "original", "optimized", "ms original", "ms optimized", "delta ms"]
    return (
        f"<h3>Against the original at ORT_ENABLE_ALL: run {cmp['run_ms_original']:.3f} ms → "
        f"{cmp['run_ms_optimized']:.3f} ms (ratio {_e(cmp['ratio'])})</h3>"
        + _table(head, rows, {1, 2, 3, 4, 5}, "profile-compare")
    )


def render_profile_html(prof: dict[str, Any]) -> str:
    """``graphopt profile --html``: the profile as one page (the account, the regions, the
    missed fusions by time, the comparison with the original)."""
    regions = [
        [_e(g["region"]), g["count"], f"{g['ms']:.3f}", _pct(g["share"])]
        for g in prof["regions"][:30]
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>graphopt profile: {_e(prof["model"])}</title>
<style>{_CSS}</style></head><body>
<h1>graphopt profile</h1>
<div class="muted">{_e(prof["model"])}</div>
{_profile_section(prof)}
<h3>Regions</h3>{_table(["region", "nodes", "ms", "share"], regions, {1, 2, 3}, "profile-regions")}
{_compare_section(prof.get("compare"))}
</body></html>
"""


def _parity_section(p: dict[str, Any] | None) -> str:
    if not p:
        return ""
    title = f"against the {_e(p.get('reference', 'original'))}"
    if not p.get("ran"):
        return f"<h3>{title}</h3><p class='muted'>not run: {_e(p.get('error'))}</p>"
    verdict = '<span class="ok">ok</span>' if p["ok"] else '<span class="bad">FAILED</span>'
    rows = [
        [
            _e(o["name"]),
            _e(o["dtype"]),
            f"{o['max_abs']:.3g}",
            f"{o['max_rel']:.3g}",
            f"{o.get('mean_abs', 0):.3g}",
            f"{o['mismatch']:.2%}",
            f"{o.get('cosine', 1):.6f}",
            o.get("nonfinite_mismatch", 0),
            '<span class="ok">yes</span>' if o["ok"] else '<span class="bad">NO</span>',
        ]
        for o in p.get("outputs", [])
    ]
    extra = ""
    if p.get("first_divergence"):
        d = p["first_divergence"]
        extra = (
            f"<p>first diverging tensor: <code>{_e(d['tensor'])}</code> from {_e(d['op'])} "
            f"<code>{_e(d['producer'])}</code></p>"
        )
    return (
        f"<h3>{title}: {verdict}</h3>"
        + _table(
            [
                "output",
                "dtype",
                "max abs",
                "max rel",
                "mean abs",
                "mismatch",
                "cosine",
                "non-finite mismatch",
                "ok",
            ],
            rows,
            {2, 3, 4, 5, 6, 7},
            "parity-table",
        )
        + extra
    )


def render_html(report: dict[str, Any], manifest: dict[str, Any] | None = None) -> str:
    """The report (``Report.to_dict()``) as one HTML page."""
    r = report
    cards = [
        ("nodes", f"{r['nodes_before']} → {r['nodes_after']}"),
        ("rewrites", r.get("rewrites", 0)),
        (
            "parity",
            "ok"
            if r["parity"].get("ok")
            else ("not run" if not r["parity"].get("ran") else "FAILED"),
        ),
        ("time", f"{r.get('seconds', {}).get('total', 0):.2f} s"),
    ]
    card_html = "".join(
        f'<div class="card"><span class="muted">{_e(k)}</span><b>{_e(v)}</b></div>'
        for k, v in cards
    )
    passes: dict[str, list[float]] = {}
    for p in r.get("passes", []):
        passes.setdefault(p["name"], [0.0, 0])
        passes[p["name"]][0] += p["seconds"]
        passes[p["name"]][1] += int(p["changed"])
    pass_rows = [[_e(k), f"{v[0]:.4f}", v[1]] for k, v in passes.items()]
    rule_rows = [
        [_e(k), v["attempts"], v["fired"], v["missed"], f"{v['seconds']:.4f}"]
        for k, v in r.get("rules", {}).items()
        if v["attempts"] or v["fired"]
    ]
    kinds = sorted({x["kind"] for x in r.get("remarks", [])})
    rules = sorted({x["rule"] for x in r.get("remarks", [])})
    opts = lambda xs: "".join(f'<option value="{_e(x)}">{_e(x)}</option>' for x in xs)  # noqa: E731
    remark_json = json.dumps(r.get("remarks", []), sort_keys=True).replace("</", "<\\/")
    manifest_html = ""
    if manifest:
        nodes = manifest.get("nodes", [])
        rows = [
            [
                _e(n.get("name", "")),
                _e(n.get("op", "")),
                _e(n.get("domain", "")),
                _e(
                    n.get("provider", n.get("kernel", {}).get("provider", ""))
                    if isinstance(n.get("kernel"), dict)
                    else n.get("provider", "")
                ),
                _e(n.get("dtype", "")),
            ]
            for n in nodes[:500]
        ]
        manifest_html = (
            "<h2>Bundle manifest</h2>"
            + _table(["node", "op", "domain", "provider", "dtype"], rows, table_id="manifest-table")
            + (
                f"<p class='muted'>{len(nodes) - 500} more nodes in manifest.json</p>"
                if len(nodes) > 500
                else ""
            )
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>graphopt report: {_e(r["model"])}</title>
<style>{_CSS}</style></head><body>
<h1>graphopt report</h1>
<div class="muted">{_e(r["model"])} · target <b>{_e(r["target"])}</b> · -O{_e(r["level"])} ·
pipeline <code>{_e(r["pipeline"])}</code></div>
<div class="cards">{card_html}</div>
<h2>Ops before and after</h2>{_histogram(r.get("ops_before", {}), r.get("ops_after", {}))}
<h2>Time per pass</h2>{
        _table(["pass", "seconds", "runs that changed"], pass_rows, {1, 2}, "pass-table")
    }
<h2>Rules</h2>{
        _table(
            ["rule", "attempts", "fired", "missed", "seconds"],
            rule_rows,
            {1, 2, 3, 4},
            "rule-table",
        )
    }
<h2>Parity</h2>{_parity_section(r.get("parity"))}{_parity_section(r.get("parity_float64"))}
{_profile_section(r.get("profile"))}
<h2>Remarks <span class="muted" id="remarks-count"></span></h2>
<div class="filters"><select id="f-kind"><option value="">all kinds</option>{opts(kinds)}
</select><select id="f-rule"><option value="">all rules</option>{opts(rules)}</select>
<input id="f-text" placeholder="filter text"></div>
<table id="remarks-table"><thead><tr><th>kind</th><th>rule</th><th>code</th><th>nodes</th>
<th>message</th></tr></thead><tbody id="remarks-body"></tbody></table>
{manifest_html}
<script type="application/json" id="remark-data">{remark_json}</script>
<script>{_JS}</script>
</body></html>
"""
