"""The viewer's pages as Jinja2 templates (autoescaped), kept in code so they ship with the package."""

BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }} · posttrain viewer</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#24292f;color:#fff;padding:8px 16px}header a{color:#fff;margin-right:16px;text-decoration:none}
main{padding:12px 16px}h1{font-size:20px;margin:4px 0 10px}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff;margin:4px 0 12px}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#777}.pass{color:#1a7f37;font-weight:600}.fail{color:#cf222e;font-weight:600}
.gained{background:#dafbe1}.lost{background:#ffebe9}.badge{display:inline-block;border-radius:8px;padding:0 6px;font-size:12px;background:#eee;margin-right:3px}
.badge.flawed{background:#fff8c5}.badge.signal{background:#ffebe9}
pre{background:#fff;border:1px solid #ddd;padding:8px;white-space:pre-wrap;word-break:break-word;margin:4px 0;max-height:480px;overflow:auto}
.diff .add{color:#1a7f37}.diff .del{color:#cf222e}.diff .hunk{color:#8250df}
.turn{border-left:4px solid #ccc;padding:2px 10px;margin:8px 0;background:#fff}
.turn.prompt,.turn.task{border-color:#8c8c8c}.turn.action,.turn.model{border-color:#4c72b0}.turn.observation{border-color:#55a868}
.turn h3{font-size:13px;margin:4px 0;color:#555}
.tok{white-space:pre-wrap}.tok.m1{background:#dbe9ff}.tokens{font:12px/1.5 monospace;background:#fff;border:1px solid #ddd;padding:6px;max-height:360px;overflow:auto}
.charts{display:flex;flex-wrap:wrap;gap:12px}figure.chart{margin:0;background:#fff;border:1px solid #ddd;padding:6px}
figcaption{font-size:12px;font-weight:600}.legend{font-size:11px}svg .tick{font-size:10px;fill:#555}svg .axis{stroke:#999}
form.filters{background:#fff;border:1px solid #ddd;padding:6px 8px;margin:6px 0}form.filters label{margin-right:10px}
dl.kv{display:grid;grid-template-columns:max-content auto;gap:2px 12px;background:#fff;border:1px solid #ddd;padding:6px 10px}
dl.kv dt{font-weight:600}dl.kv dd{margin:0}
.uplot-chart{min-width:320px}.exports{font-size:12px;margin:2px 0 8px}.exports a{margin-right:8px}
.smoothing{font-size:12px;margin:4px 0}#live{font-size:12px;color:#1a7f37}
</style><link rel="stylesheet" href="/static/uplot/uPlot.min.css"><script src="/static/uplot/uPlot.iife.min.js"></script></head><body>
<header><a href="/"><b>posttrain viewer</b></a><a href="/">runs</a><a href="/evals">evals</a><a href="/compare">compare</a><a href="/find">find</a>
{% if tensorboard %}<a href="/tensorboard">TensorBoard</a>{% endif %}<span class="muted">{{ home }}</span></header>
<main>{% if exports %}<div class="exports">take away: {% for label, href in exports %}<a class="export" href="{{ href }}">{{ label }}</a>{% endfor %}</div>{% endif %}
{% if live %}<div id="live" data-url="{{ live }}" data-version="{{ version }}">live: this run is training; the page reloads when it writes a step</div>{% endif %}
{% block body %}{% endblock %}</main>
<script>
// uPlot draws every chart from its data-chart; the smoothing slider recomputes an EMA of each series
window.posttrainCharts = [];
function ema(ys, alpha) { if (!alpha) return ys; let s = null; return ys.map(y => y == null ? null : (s = s == null ? y : alpha * s + (1 - alpha) * y)); }
function drawCharts() {
  const smooth = parseFloat((document.getElementById("smoothing") || {}).value || "0");
  for (const u of window.posttrainCharts) u.destroy();
  window.posttrainCharts = [];
  if (typeof uPlot === "undefined") return;
  for (const el of document.querySelectorAll(".uplot-chart")) {
    const spec = JSON.parse(el.dataset.chart);
    el.innerHTML = "";
    const data = [spec.data[0], ...spec.data.slice(1).map(ys => spec.scatter ? ys : ema(ys, smooth))];
    const series = [{label: spec.x_label}, ...spec.names.map((n, i) => ({label: n, stroke: spec.colors[i], width: 1.5,
      paths: spec.scatter ? () => null : undefined, points: {show: spec.scatter || data[0].length <= 60, size: spec.scatter ? 4 : 5, fill: spec.colors[i]},
      spanGaps: true}))];
    const u = new uPlot({width: Math.max(320, Math.min(560, el.parentElement.clientWidth || 420)), height: 200,
      series, scales: {x: {time: false}}, cursor: {drag: {x: true, y: false}},
      axes: [{label: spec.x_label, size: 40}, {label: spec.y_label || "", size: 60}]}, data, el);
    u.spec = spec;
    window.posttrainCharts.push(u);
  }
}
document.addEventListener("DOMContentLoaded", () => {
  drawCharts();
  const slider = document.getElementById("smoothing");
  if (slider) slider.addEventListener("input", () => { document.getElementById("smoothing-value").textContent = slider.value; drawCharts(); });
  const live = document.getElementById("live");
  if (live) setInterval(async () => {
    try {
      const r = await fetch(live.dataset.url + "?format=json", {cache: "no-store"});
      const v = await r.json();
      if (v.version !== live.dataset.version) location.reload();
    } catch (e) {}
  }, 2000);
});
</script></body></html>
"""

INDEX = """{% extends "base" %}{% block body %}
<h1>Runs</h1>
{% if runs %}<table id="runs"><tr><th>run</th><th>steps</th><th>state</th><th>rollouts</th><th>ready, not trained on</th><th>checkpoints (steps)</th></tr>
{% for r in runs %}<tr><td><a href="{{ r.link }}">{{ r.run }}</a></td><td class="num">{{ r.steps }}{% if r.of_steps %} of {{ r.of_steps }}{% endif %}</td>
<td>{{ "finished" if r.finished else "training or stopped" }}</td><td class="num">{{ r.rollouts }}</td>
<td class="num">{% if r.finished %}{{ r.ready }} left over (the run ended before a step took them){% else %}{{ r.ready }}{% endif %}</td><td>{{ r.checkpoints|join(", ") }}</td></tr>{% endfor %}</table>
<p><a href="/compare?runs={{ runs|map(attribute='run')|join(',') }}">compare these runs' curves</a> · <a href="/find">find in rollouts and attempts</a></p>
{% else %}<p class="muted">no run under {{ home }}/runs</p>{% endif %}
{% include "evals_table" %}
{% endblock %}"""

EVALS_TABLE = """<h1>Evaluated checkpoints</h1>
{% if checkpoints %}<table><tr><th>checkpoint</th><th>eval runs</th><th>newest run</th><th>written</th></tr>
{% for c in checkpoints %}<tr><td><a href="{{ c.link }}">{{ c.checkpoint }}</a></td><td class="num">{{ c.runs }}</td><td>{{ c.run_id }}</td><td>{{ c.written }}</td></tr>{% endfor %}</table>
{% else %}<p class="muted">no eval rows under {{ home }}/evals/deepswe</p>{% endif %}"""

EVALS = """{% extends "base" %}{% block body %}{% include "evals_table" %}{% endblock %}"""

RUN = """{% extends "base" %}{% block body %}
<h1>Run {{ run }}</h1>
<p id="state">{{ steps|length }} step(s){% if of_steps %} of {{ of_steps }}{% endif %}{% if finished %} · finished{% elif eta %} · ETA {{ eta }} at the pace of the last steps{% endif %}
· checkpoints: {% for c in checkpoints %}<a href="{{ c.link }}">step {{ c.step }}</a>{% if not loop.last %}, {% endif %}{% else %}none{% endfor %}
· <a href="{{ compare_link }}">compare with other runs</a> · <a href="/find?run={{ run }}">find in its rollouts</a>{% if tensorboard %} · <a href="/tensorboard">TensorBoard</a> (overlays runs too){% endif %}</p>
<h2>Curves by step</h2><div class="smoothing"><label>smoothing <input id="smoothing" type="range" min="0" max="0.95" step="0.05" value="0"> <span id="smoothing-value">0</span></label> · drag across a chart to zoom, double-click to reset</div>
<div class="charts">{% for chart in curves %}{{ chart|safe }}{% endfor %}</div>
<h2>Time per phase</h2>{{ phases|safe }}
<p class="muted">Episode phases are summed over the step's rollouts (episodes run side by side, so they exceed the wall clock); wait and train are the trainer's wall clock (publish time is in TensorBoard and the step observations).</p>
<h2>Steps</h2>
<p class="muted">A step trains on the rollouts it consumed (groups with reward variance; a zero-variance group is consumed and dropped); rollouts discarded as stale were never trained on, so their rewards are apart.</p>
<table id="steps"><tr><th>step</th><th>groups</th><th>rollouts</th><th>consumed (trained on)</th><th>mean reward, consumed</th><th>discarded (stale)</th><th>mean reward, discarded</th><th>mean response tokens, consumed</th></tr>
{% for s in store_steps %}<tr><td><a href="{{ s.link }}">{{ s.step }}</a></td><td class="num">{{ s.groups }}</td><td class="num">{{ s.rollouts }}</td>
<td class="num">{{ s.consumed }}</td><td class="num">{{ num(s.reward_mean_consumed) }}</td><td class="num">{{ s.discarded }}</td><td class="num">{{ num(s.reward_mean_discarded) }}</td>
<td class="num">{{ num(s.generated_tokens_mean_consumed, "%.0f") }}</td></tr>{% endfor %}</table>
{% endblock %}"""

STEP = """{% extends "base" %}{% block body %}
<h1><a href="{{ run_link }}">{{ run }}</a> · step {{ step }}</h1>
<p>{{ n_groups }} group(s), {{ n_rollouts }} rollout(s){% if filtered %} matching the filters{% endif %} ({% for k, v in statuses.items() %}{{ v }} {{ k }}{% if not loop.last %}, {% endif %}{% endfor %}){% if row %} · loss {{ "%.4f"|format(row.loss) }}, solve rate {{ "%.3f"|format(row.solve_rate) }}, zero-variance groups {{ row.zero_variance_groups }}{% endif %}</p>
<form class="filters" method="get">
<label>reward ≥ <input name="min_reward" size="4" value="{{ q.min_reward or '' }}"></label>
<label>reward ≤ <input name="max_reward" size="4" value="{{ q.max_reward or '' }}"></label>
<label>signal <select name="signal"><option value="">any</option>{% for s in signals %}<option {% if s == q.signal %}selected{% endif %}>{{ s }}</option>{% endfor %}</select></label>
<label>task <input name="task" size="16" value="{{ q.task or '' }}"></label>
<label>status <select name="status"><option value="">any</option>{% for s in ["consumed", "discarded", "ready"] %}<option {% if s == q.status %}selected{% endif %}>{{ s }}</option>{% endfor %}</select></label>
<button>filter</button></form>
<h2>Distributions</h2>{% if not q.status %}<p class="muted">Over the rollouts the step trained on (consumed); the rewards of those it discarded as stale are drawn apart.</p>{% endif %}<div class="charts">{% for chart in charts %}{{ chart|safe }}{% endfor %}</div>
<h2>Groups and rollouts</h2>
<table><tr><th>group</th><th>task</th><th>adapter step</th><th>rollout</th><th>status</th><th>reward</th><th>advantage</th><th>response tokens</th><th>turns</th><th>stop reason</th><th>signals</th></tr>
{% for g in groups %}{% for r in g.rollouts %}<tr>
{% if loop.first %}<td rowspan="{{ g.rollouts|length }}">{{ g.group_id }}<br><span class="muted">spread {{ "%.3f"|format(g.spread) }}</span></td>
<td rowspan="{{ g.rollouts|length }}">{{ g.task_id }}</td><td rowspan="{{ g.rollouts|length }}" class="num">{{ g.adapter_step }}</td>{% endif %}
<td><a href="{{ link(r.rollout_id) }}">{{ r.rollout_id }}</a></td><td class="status-{{ r.status }}">{{ r.status }}{% if r.status == "discarded" %} (not trained on){% endif %}</td><td class="num">{{ "%.3f"|format(r.reward) }}</td>
<td class="num">{{ "%+.3f"|format(r.advantage) }}</td><td class="num">{{ r.generated_tokens }}</td><td class="num">{{ r.turns }}</td>
<td>{{ r.info.get("stop_reason", "") }}</td><td>{% for s in r.signals %}<span class="badge signal">{{ s }}</span>{% endfor %}</td></tr>{% endfor %}{% endfor %}
</table>{% endblock %}"""

ROLLOUT = """{% extends "base" %}{% block body %}
<h1><a href="{{ run_link }}">{{ run }}</a> · {% if step_link %}<a href="{{ step_link }}">step {{ r.status_step }}</a> · {% endif %}rollout {{ r.rollout_id }}</h1>
<dl class="kv"><dt>task</dt><dd>{{ r.task_id }}</dd><dt>group</dt><dd>{{ r.group_id }} (rewards {{ group_rewards }})</dd>
<dt>reward</dt><dd class="{{ 'pass' if r.reward >= 1 else 'fail' }}" id="reward">{{ "%.3f"|format(r.reward) }}</dd>
<dt>advantage</dt><dd>{{ "%+.4f"|format(r.advantage) }}</dd><dt>adapter step</dt><dd>{{ r.adapter_step }}</dd>
<dt>status</dt><dd>{{ r.status }}{% if r.status_step is not none %} at step {{ r.status_step }}{% endif %}</dd>
<dt>stop reason</dt><dd>{{ r.info.get("stop_reason", "–") }}</dd><dt>turns</dt><dd>{{ r.turns }}</dd>
<dt>tokens</dt><dd>{{ tokens }} in all, {{ trained }} trained on (mask 1)</dd>
<dt>signals</dt><dd>{% for s in r.signals %}<span class="badge signal">{{ s }}</span>{% else %}none{% endfor %}</dd>
<dt>stored</dt><dd>{{ created }}</dd>
{% for k, v in info %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>
<h2>Turns</h2>
{% for s in segments %}<div class="turn {{ s.kind }}"><h3>{% if s.kind == "prompt" %}prompt{% elif s.kind == "action" %}turn {{ s.turn }} · action (generated, trained on: {{ s.tokens|length }} tokens, mean logprob {{ "%.3f"|format(s.mean_logprob) }}){% else %}turn {{ s.turn }} · observation{% endif %}</h3>
<pre>{{ s.text }}</pre></div>{% endfor %}
<h2>Tokens and mask</h2><p class="muted">Blue tokens are the model's (mask 1, trained on); hover for the id and the serving logprob.</p>
<div class="tokens">{% for s in segments %}{% for t in s.tokens %}<span class="tok m{{ 1 if s.kind == 'action' else 0 }}" title="id {{ t[0] }}{% if s.kind == 'action' %} logprob {{ '%.4f'|format(t[2]) }}{% endif %}">{{ t[1] }}</span>{% endfor %}{% endfor %}</div>
{% endblock %}"""

CHECKPOINT = """{% extends "base" %}{% block body %}
<h1>Checkpoint {{ checkpoint }}</h1>
<p>eval run {{ run_id }}{% if runs|length > 1 %} (runs: {% for r in runs %}<a href="?run={{ r }}">{{ r }}</a>{% if not loop.last %}, {% endif %}{% endfor %}){% endif %}
· compared with {% if base %}<a href="{{ base_link }}">{{ base }}</a> (run {{ base_run_id }}){% else %}no other checkpoint's eval{% endif %}
· {{ gained }} task(s) gained, {{ lost }} lost</p>
<form class="filters" method="get" id="against-form">{% if q.run %}<input type="hidden" name="run" value="{{ q.run }}">{% endif %}
<label>compare with <select name="against">{% for c in checkpoints %}<option {% if c == base %}selected{% endif %}>{{ c }}</option>{% endfor %}</select></label><button>compare</button></form>
{% macro est(e) %}{% if e %}{{ "%.3f"|format(e.value) }} [{{ "%.3f"|format(e.low) }}, {{ "%.3f"|format(e.high) }}]{% else %}–{% endif %}{% endmacro %}
{% macro change(e) %}{% if e %}{{ "%+.3f"|format(e.value) }} [{{ "%+.3f"|format(e.low) }}, {{ "%+.3f"|format(e.high) }}]{% else %}–{% endif %}{% endmacro %}
<table id="summary"><tr><th>level</th><th>tasks</th><th>pass@1 {{ checkpoint }} (95% CI)</th><th>pass@1 {{ base or "–" }} (95% CI)</th><th>change, paired over tasks (95% CI)</th><th>paired tasks</th></tr>
<tr><td><b>all</b></td><td class="num">{{ summary.tasks }}</td><td class="num">{{ est(summary["pass@1"]) }}</td><td class="num">{{ est(summary["against_pass@1"]) }}</td><td class="num">{{ change(summary.change) }}</td><td class="num">{{ summary.paired_tasks }}</td></tr>
{% for l in summary.levels %}<tr><td>level {{ l.level }}</td><td class="num">{{ l.tasks }}</td><td class="num">{{ est(l["pass@1"]) }}</td><td class="num">{{ est(l["against_pass@1"]) }}</td><td class="num">{{ change(l.change) }}</td><td class="num">{{ l.paired_tasks }}</td></tr>{% endfor %}</table>
<p class="muted">pass@1: the mean over tasks of each task's share of graded attempts that pass, with a 95% bootstrap interval over tasks; the change is paired on the tasks both checkpoints were graded on (as eval_report's headline).</p>
<form class="filters" method="get">{% if q.run %}<input type="hidden" name="run" value="{{ q.run }}">{% endif %}{% if q.against %}<input type="hidden" name="against" value="{{ q.against }}">{% endif %}
<label>task <input name="task" size="16" value="{{ q.task or '' }}"></label>
<label>level <select name="level"><option value="">any</option>{% for l in levels %}<option {% if l|string == q.level %}selected{% endif %}>{{ l }}</option>{% endfor %}</select></label>
<label>flip <select name="flip"><option value="">any</option>{% for f in ["gained", "lost", "flipped"] %}<option {% if f == q.flip %}selected{% endif %}>{{ f }}</option>{% endfor %}</select></label>
<label><input type="checkbox" name="flawed" value="1" {% if q.flawed %}checked{% endif %}> flawed only</label>
<button>filter</button></form>
<table id="tasks"><tr><th>task</th><th>level</th><th>passes at {{ base or "–" }}</th><th>passes</th><th>pass@1 at {{ base or "–" }}</th><th>pass@1</th><th>change</th><th>flip</th><th>flagged</th><th>flawed lists</th></tr>
{% for t in rows %}<tr class="{{ t.flip }}"><td><a href="{{ t.link }}">{{ t.task_id }}</a></td><td class="num">{{ t.level }}</td>
<td class="num">{% if t.base_attempts is not none %}{{ t.base_passes }}/{{ t.base_attempts }}{% else %}–{% endif %}</td><td class="num">{{ t.passes }}/{{ t.attempts }}</td>
<td class="num">{{ num(t["base_pass@1"]) }}</td><td class="num">{{ num(t["pass@1"]) }}</td><td class="num">{{ num(t.change, "%+.3f") }}</td><td>{{ t.flip }}</td>
<td class="num">{{ t.flagged }}</td><td>{% for f in t.flawed %}<span class="badge flawed">{{ f }}</span>{% endfor %}</td></tr>{% endfor %}</table>
{% endblock %}"""

ATTEMPTS_TABLE = """<table><tr><th>attempt</th><th>status</th><th>reward</th><th>target tests passed</th><th>existing tests passed</th><th>partial</th><th>turns</th><th>stop reason</th><th>committed</th><th>signals</th></tr>
{% for a in attempts %}<tr><td>{% if link %}<a href="{{ link(a.attempt) }}">{{ a.attempt }}</a>{% else %}{{ a.attempt }}{% endif %}</td><td>{{ a.status }}</td>
<td class="num {{ 'pass' if (a.reward or 0) >= 1 else 'fail' }}">{{ num(a.reward) }}</td><td class="num">{{ a.f2p_passed if a.f2p_passed is not none else "–" }}/{{ a.f2p_total if a.f2p_total is not none else "–" }}</td>
<td class="num">{{ a.p2p_passed if a.p2p_passed is not none else "–" }}/{{ a.p2p_total if a.p2p_total is not none else "–" }}</td><td class="num">{{ num(a.partial) }}</td><td class="num">{{ a.turns }}</td>
<td>{{ a.stop_reason }}</td><td>{{ "yes" if a.committed else "no" }}</td><td>{% for s in (a.signals or "").split(",") if s %}<span class="badge signal">{{ s }}</span>{% endfor %}</td></tr>{% endfor %}</table>"""

TASK = """{% extends "base" %}{% block body %}
<h1><a href="{{ ckpt_link }}">{{ checkpoint }}</a> · task {{ task_id }}</h1>
<p>{% for f in flawed %}<span class="badge flawed">flawed: {{ f }}</span>{% endfor %}eval run {{ run_id }}</p>
<h2>Attempts at {{ checkpoint }}</h2>{% with attempts=attempts, link=link %}{% include "attempts_table" %}{% endwith %}
{% if base %}<h2>Attempts at the base model ({{ base }})</h2>{% with attempts=base_attempts, link=base_link %}{% include "attempts_table" %}{% endwith %}{% endif %}
{% endblock %}"""

ATTEMPT = """{% extends "base" %}{% block body %}
<h1><a href="{{ ckpt_link }}">{{ checkpoint }}</a> · <a href="{{ task_link }}">{{ task_id }}</a> · attempt {{ attempt }}</h1>
<dl class="kv"><dt>status</dt><dd>{{ row.status }}</dd><dt>reward</dt><dd class="{{ 'pass' if (row.reward or 0) >= 1 else 'fail' }}" id="reward">{{ num(row.reward) }}</dd>
<dt>target tests</dt><dd>{{ row.f2p_passed }}/{{ row.f2p_total }} passed (target score {{ num(row.target_score) }}, strict {{ num(row.strict_target_score) }})</dd>
<dt>existing tests</dt><dd>{{ row.p2p_passed }}/{{ row.p2p_total }} passed</dd><dt>partial</dt><dd>{{ num(row.partial) }}</dd>
<dt>committed</dt><dd>{{ "yes" if row.committed else "no" }}</dd><dt>stop reason</dt><dd>{{ row.stop_reason }}</dd><dt>turns</dt><dd>{{ row.turns }} ({{ row.output_tokens }} tokens)</dd>
<dt>time</dt><dd>agent {{ num(row.agent_s, "%.1f") }} s, grading {{ num(row.grade_s, "%.1f") }} s</dd>
<dt>signals</dt><dd>{% for s in signals %}<span class="badge signal">{{ s }}</span>{% else %}none{% endfor %}</dd>
<dt>flawed lists</dt><dd>{% for f in flawed %}<span class="badge flawed">{{ f }}</span>{% else %}none{% endfor %}</dd>
<dt>adapter version</dt><dd>{{ row.adapter_version or "base" }}</dd>{% if row.detail %}<dt>detail</dt><dd>{{ row.detail }}</dd>{% endif %}</dl>
<h2>Tests</h2>{% if tests %}<table id="tests"><tr><th>test</th><th>kind</th><th>outcome</th></tr>
{% for t in tests %}<tr><td>{{ t.test }}</td><td>{{ t.kind }}</td><td class="{{ 'pass' if t.outcome == 'passed' else 'fail' }}">{{ t.outcome }}</td></tr>{% endfor %}</table>
{% else %}<p class="muted">no test outcomes recorded for this attempt</p>{% endif %}
<h2>Committed diff</h2>{% if diff %}<pre class="diff" id="diff">{% for line in diff.splitlines() %}<span class="{{ 'hunk' if line.startswith('@@') else 'add' if line.startswith('+') and not line.startswith('+++') else 'del' if line.startswith('-') and not line.startswith('---') else '' }}">{{ line }}</span>
{% endfor %}</pre>{% elif row.committed %}<p class="muted">the agent committed, but this attempt's row keeps no diff (a Harbor attempt's verification is under evals/harbor/)</p>{% else %}<p class="muted">nothing committed</p>{% endif %}
<h2>Transcript</h2>{% if prompt %}<div class="turn prompt" id="shown-prompt"><h3>prompt the model was shown (rendered again from the task in the home's bundled suite: instruction, numbered file, failing tests)</h3><pre>{{ prompt }}</pre></div>{% endif %}{% for m in transcript %}<div class="turn {{ m.role }}"><h3>{% if m.turn is defined %}turn {{ m.turn }} · {% endif %}{{ m.role }}{% if m.get('action') %} · {{ m.action.tool }}{% endif %}</h3>
{% if m.role == "action" %}<pre class="args">{{ m.action.args|pretty_json }}</pre><pre>{{ m.observation }}</pre>{% else %}<pre>{{ m.text }}</pre>{% endif %}</div>{% else %}<p class="muted">no transcript recorded</p>{% endfor %}
{% if row.test_output %}<h2>Test output</h2><pre>{{ row.test_output }}</pre>{% endif %}
{% endblock %}"""

COMPARE = """{% extends "base" %}{% block body %}
<h1>Compare runs</h1>
<form class="filters" method="get"><label>runs (comma-separated) <input name="runs" size="40" value="{{ names|join(',') }}"></label>
<button>compare</button> <span class="muted">runs here: {% for r in every %}<a href="/compare?runs={{ r }}">{{ r }}</a>{% if not loop.last %}, {% endif %}{% endfor %}</span></form>
{% if names %}<p>{% for n in names %}<a href="{{ run_links[n] }}">{{ n }}</a>{% if not loop.last %} · {% endif %}{% endfor %}{% if tensorboard %} · <a href="/tensorboard">TensorBoard</a> overlays every series of every run{% endif %}</p>
<div class="smoothing"><label>smoothing <input id="smoothing" type="range" min="0" max="0.95" step="0.05" value="0"> <span id="smoothing-value">0</span></label> · drag to zoom, double-click to reset</div>
<div class="charts">{% for chart in curves %}{{ chart|safe }}{% endfor %}</div>
<p class="muted">Two checkpoints side by side: open a checkpoint and pick "compare with", or /compare/evals?a=CHECKPOINT&amp;b=OTHER.</p>{% endif %}
{% endblock %}"""

FIND = """{% extends "base" %}{% block body %}
<h1>Find</h1>
<form class="filters" method="get" id="find-form"><label>text <input name="q" size="30" value="{{ p.q }}"></label>
<label><input type="checkbox" name="regex" value="1" {% if p.regex %}checked{% endif %}> regular expression</label>
<label>in run's rollouts <select name="run"><option value="">(eval attempts instead)</option>{% for r in runs %}<option {% if r == p.run %}selected{% endif %}>{{ r }}</option>{% endfor %}</select></label>
<label>step <input name="step" size="4" value="{{ p.step }}"></label>
<label>or checkpoint's attempts <select name="checkpoint"><option value="">every checkpoint</option>{% for c in checkpoints %}<option {% if c == p.checkpoint %}selected{% endif %}>{{ c }}</option>{% endfor %}</select></label>
<label>status <input name="status" size="9" value="{{ p.status }}"></label><label>task <input name="task" size="12" value="{{ p.task }}"></label>
<label>reward ≥ <input name="min_reward" size="4" value="{{ p.min_reward }}"></label><label>reward ≤ <input name="max_reward" size="4" value="{{ p.max_reward }}"></label>
<button>find</button></form>
{% if result %}<p id="found">{{ result.hits|length }}{% if result.more %}+ (the first {{ result.hits|length }}){% endif %} match(es) in {{ result.searched }} {{ "rollouts" if p.run else "attempts" }} searched</p>
<table id="hits"><tr>{% if p.run %}<th>rollout</th><th>step</th>{% else %}<th>checkpoint</th><th>task</th><th>attempt</th>{% endif %}<th>status</th><th>reward</th><th>matched in</th><th>context</th></tr>
{% for h in result.hits %}<tr>{% if p.run %}<td><a href="{{ h.link }}">{{ h.rollout_id }}</a></td><td class="num">{{ h.step if h.step is not none else "ready" }}</td>
{% else %}<td>{{ h.checkpoint }}</td><td>{{ h.task_id }}</td><td><a href="{{ h.link }}">{{ h.attempt }}</a></td>{% endif %}
<td>{{ h.status }}</td><td class="num">{{ num(h.reward) }}</td><td>{{ h.matched }}</td><td><code>{{ h.snippet }}</code></td></tr>{% endfor %}</table>{% endif %}
{% endblock %}"""

NOT_FOUND = """{% extends "base" %}{% block body %}<h1>Not found</h1><p>{{ message }}</p>{% endblock %}"""

TEMPLATES = {"base": BASE, "index": INDEX, "evals_table": EVALS_TABLE, "evals": EVALS, "run": RUN, "step": STEP,
             "rollout": ROLLOUT, "checkpoint": CHECKPOINT, "attempts_table": ATTEMPTS_TABLE, "task": TASK,
             "attempt": ATTEMPT, "compare": COMPARE, "find": FIND, "not_found": NOT_FOUND}
