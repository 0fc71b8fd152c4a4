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
</style></head><body>
<header><a href="/"><b>posttrain viewer</b></a><a href="/">runs</a><a href="/evals">evals</a>
{% if tensorboard %}<a href="/tensorboard">TensorBoard</a>{% endif %}<span class="muted">{{ home }}</span></header>
<main>{% block body %}{% endblock %}</main></body></html>
"""

INDEX = """{% extends "base" %}{% block body %}
<h1>Runs</h1>
{% if runs %}<table><tr><th>run</th><th>steps</th><th>rollouts</th><th>not yet trained on</th><th>checkpoints (steps)</th></tr>
{% for r in runs %}<tr><td><a href="{{ r.link }}">{{ r.run }}</a></td><td class="num">{{ r.steps }}{% if r.of_steps %} of {{ r.of_steps }}{% endif %}</td>
<td class="num">{{ r.rollouts }}</td><td class="num">{{ r.ready }}</td><td>{{ r.checkpoints|join(", ") }}</td></tr>{% endfor %}</table>
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
<p>{{ steps|length }} step(s){% if of_steps %} of {{ of_steps }}{% endif %}{% if eta %} · ETA {{ eta }} at the pace of the last steps{% endif %}
· checkpoints: {% for c in checkpoints %}<a href="{{ c.link }}">step {{ c.step }}</a>{% if not loop.last %}, {% endif %}{% else %}none{% endfor %}</p>
<h2>Curves by step</h2><div class="charts">{% for chart in curves %}{{ chart|safe }}{% endfor %}</div>
<h2>Time per phase</h2>{{ phases|safe }}
<p class="muted">Episode phases are summed over the step's rollouts (episodes run side by side, so they exceed the wall clock); wait and train are the trainer's wall clock (publish time is in TensorBoard and the step observations).</p>
<h2>Steps</h2>
<table><tr><th>step</th><th>groups</th><th>rollouts</th><th>discarded</th><th>mean reward</th><th>mean response tokens</th></tr>
{% for s in store_steps %}<tr><td><a href="{{ s.link }}">{{ s.step }}</a></td><td class="num">{{ s.groups }}</td><td class="num">{{ s.rollouts }}</td>
<td class="num">{{ s.discarded }}</td><td class="num">{{ "%.3f"|format(s.reward_mean or 0) }}</td><td class="num">{{ "%.0f"|format(s.generated_tokens_mean or 0) }}</td></tr>{% endfor %}</table>
{% endblock %}"""

STEP = """{% extends "base" %}{% block body %}
<h1><a href="{{ run_link }}">{{ run }}</a> · step {{ step }}</h1>
<p>{{ n_groups }} group(s), {{ n_rollouts }} rollout(s){% if filtered %} matching the filters{% endif %}{% if row %} · loss {{ "%.4f"|format(row.loss) }}, solve rate {{ "%.3f"|format(row.solve_rate) }}, zero-variance groups {{ row.zero_variance_groups }}{% endif %}</p>
<form class="filters" method="get">
<label>reward ≥ <input name="min_reward" size="4" value="{{ q.min_reward or '' }}"></label>
<label>reward ≤ <input name="max_reward" size="4" value="{{ q.max_reward or '' }}"></label>
<label>signal <select name="signal"><option value="">any</option>{% for s in signals %}<option {% if s == q.signal %}selected{% endif %}>{{ s }}</option>{% endfor %}</select></label>
<label>task <input name="task" size="16" value="{{ q.task or '' }}"></label>
<label>status <select name="status"><option value="">any</option>{% for s in ["consumed", "discarded", "ready"] %}<option {% if s == q.status %}selected{% endif %}>{{ s }}</option>{% endfor %}</select></label>
<button>filter</button></form>
<h2>Distributions</h2><div class="charts">{% for chart in charts %}{{ chart|safe }}{% endfor %}</div>
<h2>Groups and rollouts</h2>
<table><tr><th>group</th><th>task</th><th>adapter step</th><th>rollout</th><th>status</th><th>reward</th><th>advantage</th><th>response tokens</th><th>turns</th><th>stop reason</th><th>signals</th></tr>
{% for g in groups %}{% for r in g.rollouts %}<tr>
{% if loop.first %}<td rowspan="{{ g.rollouts|length }}">{{ g.group_id }}<br><span class="muted">spread {{ "%.3f"|format(g.spread) }}</span></td>
<td rowspan="{{ g.rollouts|length }}">{{ g.task_id }}</td><td rowspan="{{ g.rollouts|length }}" class="num">{{ g.adapter_step }}</td>{% endif %}
<td><a href="{{ link(r.rollout_id) }}">{{ r.rollout_id }}</a></td><td>{{ r.status }}</td><td class="num">{{ "%.3f"|format(r.reward) }}</td>
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
· compared with {% if base %}<a href="{{ base_link }}">{{ base }}</a> (run {{ base_run_id }}){% else %}no base model eval{% endif %}
· {{ gained }} task(s) gained, {{ lost }} lost · pass@1 {{ "%.3f"|format(pass1) }}{% if base %} (base {{ "%.3f"|format(base_pass1) }}){% endif %}</p>
<form class="filters" method="get">{% if q.run %}<input type="hidden" name="run" value="{{ q.run }}">{% endif %}
<label>task <input name="task" size="16" value="{{ q.task or '' }}"></label>
<label>level <select name="level"><option value="">any</option>{% for l in levels %}<option {% if l|string == q.level %}selected{% endif %}>{{ l }}</option>{% endfor %}</select></label>
<label>flip <select name="flip"><option value="">any</option>{% for f in ["gained", "lost", "flipped"] %}<option {% if f == q.flip %}selected{% endif %}>{{ f }}</option>{% endfor %}</select></label>
<label><input type="checkbox" name="flawed" value="1" {% if q.flawed %}checked{% endif %}> flawed only</label>
<button>filter</button></form>
<table id="tasks"><tr><th>task</th><th>level</th><th>base passes</th><th>passes</th><th>base pass@1</th><th>pass@1</th><th>change</th><th>flip</th><th>flagged</th><th>flawed lists</th></tr>
{% for t in rows %}<tr class="{{ t.flip }}"><td><a href="{{ t.link }}">{{ t.task_id }}</a></td><td class="num">{{ t.level }}</td>
<td class="num">{% if t.base_attempts is not none %}{{ t.base_passes }}/{{ t.base_attempts }}{% else %}–{% endif %}</td><td class="num">{{ t.passes }}/{{ t.attempts }}</td>
<td class="num">{{ num(t["base_pass@1"]) }}</td><td class="num">{{ num(t["pass@1"]) }}</td><td class="num">{{ num(t.change, "%+.3f") }}</td><td>{{ t.flip }}</td>
<td class="num">{{ t.flagged }}</td><td>{% for f in t.flawed %}<span class="badge flawed">{{ f }}</span>{% endfor %}</td></tr>{% endfor %}</table>
{% endblock %}"""

ATTEMPTS_TABLE = """<table><tr><th>attempt</th><th>status</th><th>reward</th><th>target tests passed</th><th>existing tests passed</th><th>partial</th><th>turns</th><th>stop reason</th><th>committed</th><th>signals</th></tr>
{% for a in attempts %}<tr><td>{% if link %}<a href="{{ link(a.attempt) }}">{{ a.attempt }}</a>{% else %}{{ a.attempt }}{% endif %}</td><td>{{ a.status }}</td>
<td class="num {{ 'pass' if (a.reward or 0) >= 1 else 'fail' }}">{{ num(a.reward) }}</td><td class="num">{{ a.f2p_passed if a.f2p_passed is not none else "–" }}/{{ a.f2p_total if a.f2p_total is not none else "–" }}</td>
<td class="num">{{ a.p2p_passed if a.p2p_passed is not none else "–" }}/{{ a.p2p_total if a.p2p_total is not none else "–" }}</td><td class="num">{{ num(a.partial) }}</td><td class="num">{{ a.turns }}</td>
<td>{{ a.stop_reason }}</td><td>{{ a.committed }}</td><td>{% for s in (a.signals or "").split(",") if s %}<span class="badge signal">{{ s }}</span>{% endfor %}</td></tr>{% endfor %}</table>"""

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
<dt>committed</dt><dd>{{ row.committed }}</dd><dt>stop reason</dt><dd>{{ row.stop_reason }}</dd><dt>turns</dt><dd>{{ row.turns }} ({{ row.output_tokens }} tokens)</dd>
<dt>time</dt><dd>agent {{ num(row.agent_s, "%.1f") }} s, grading {{ num(row.grade_s, "%.1f") }} s</dd>
<dt>signals</dt><dd>{% for s in signals %}<span class="badge signal">{{ s }}</span>{% else %}none{% endfor %}</dd>
<dt>flawed lists</dt><dd>{% for f in flawed %}<span class="badge flawed">{{ f }}</span>{% else %}none{% endfor %}</dd>
<dt>adapter version</dt><dd>{{ row.adapter_version or "base" }}</dd>{% if row.detail %}<dt>detail</dt><dd>{{ row.detail }}</dd>{% endif %}</dl>
<h2>Tests</h2>{% if tests %}<table id="tests"><tr><th>test</th><th>kind</th><th>outcome</th></tr>
{% for t in tests %}<tr><td>{{ t.test }}</td><td>{{ t.kind }}</td><td class="{{ 'pass' if t.outcome == 'passed' else 'fail' }}">{{ t.outcome }}</td></tr>{% endfor %}</table>
{% else %}<p class="muted">no test outcomes recorded for this attempt</p>{% endif %}
<h2>Committed diff</h2>{% if diff %}<pre class="diff" id="diff">{% for line in diff.splitlines() %}<span class="{{ 'hunk' if line.startswith('@@') else 'add' if line.startswith('+') and not line.startswith('+++') else 'del' if line.startswith('-') and not line.startswith('---') else '' }}">{{ line }}</span>
{% endfor %}</pre>{% else %}<p class="muted">nothing committed</p>{% endif %}
<h2>Transcript</h2>{% for m in transcript %}<div class="turn {{ m.role }}"><h3>{% if m.turn is defined %}turn {{ m.turn }} · {% endif %}{{ m.role }}{% if m.get('action') %} · {{ m.action.tool }}{% endif %}</h3>
{% if m.role == "action" %}<pre>{{ m.action.args|tojson }}</pre><pre>{{ m.observation }}</pre>{% else %}<pre>{{ m.text }}</pre>{% endif %}</div>{% else %}<p class="muted">no transcript recorded</p>{% endfor %}
{% if row.test_output %}<h2>Test output</h2><pre>{{ row.test_output }}</pre>{% endif %}
{% endblock %}"""

NOT_FOUND = """{% extends "base" %}{% block body %}<h1>Not found</h1><p>{{ message }}</p>{% endblock %}"""

TEMPLATES = {"base": BASE, "index": INDEX, "evals_table": EVALS_TABLE, "evals": EVALS, "run": RUN, "step": STEP,
             "rollout": ROLLOUT, "checkpoint": CHECKPOINT, "attempts_table": ATTEMPTS_TABLE, "task": TASK,
             "attempt": ATTEMPT, "not_found": NOT_FOUND}
