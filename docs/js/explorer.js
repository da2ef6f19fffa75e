/* The schedule explorer (docs/explorer.md): recorded training steps, drawn and stepped.

   The data is explorer/schedules.json, made at build time from the real code by
   docs/hooks/explorer_data.py (see docs/hooks/explorer.py); the page's
   <div class="ts-explorer" data-src="..."> says where it is. Every number shown comes from
   that file: this script only draws (inline SVG) and moves the cursor, one hook event at a
   time (buttons, the slider, the arrow keys, or a click on a column). Plain JavaScript, no
   library: the page must work offline and read the same in ten years. */
(function () {
  "use strict";

  const NAMES = {impl: "Implementation", world: "Ranks", reshard: "reshard_after_forward",
                 prefetch: "Prefetch", dtype: "Parameters"};
  const VALUES = {prefetch: {1: "one ahead", 2: "two ahead"},
                  dtype: {fp32: "fp32", bf16: "bf16 (fp32 reduce)"}};
  const HOOK_SHORT = {pre_forward: "pre", post_forward: "post", pre_backward: "pre",
                      post_backward: "post", final_callback: "end"};
  const STATES = {U: "unsharded", S: "sharded", P: "post-forward piece", "-": "freed",
                  "*": "mixed"};
  const LABEL_W = 78, MIN_COL = 34, ROW_H = 33, MEM_H = 72, HEAD_H = 48;

  const esc = (s) => String(s).replace(/[&<>"']/g, (c) =>
    ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  const valueText = (axis, v) => (VALUES[axis] && VALUES[axis][v]) || String(v);
  const keyOf = (axes, choice) => Object.keys(axes).map((a) => String(choice[a]).toLowerCase()).join("|");

  /* A command line that wraps between its flags, never inside one. */
  const command = (text) => text.split(" --").map((w, i) => `<span class="tsx-nowrap">${esc(i ? "--" + w : w)}</span>`).join(" ");

  function when(s, c) {
    if (c.blocking) return "blocking";
    if (c.used_in === null) return "async, not used in this step";
    if (c.used_in >= s.events.length) return "async, used after the step";
    return "async, used in #" + c.used_in;
  }

  class Explorer {
    constructor(root, data) {
      this.root = root;
      this.data = data;
      this.choice = {};
      for (const [axis, values] of Object.entries(data.axes)) this.choice[axis] = values[0];
      if (data.axes.impl && data.axes.impl.includes("optimized")) this.choice.impl = "optimized";
      this.compare = null;  // an entry of data.comparisons, or null
      this.cursor = 0;
      this.restore();
      this.build();
      this.render();
      let pending = null;
      window.addEventListener("resize", () => {
        clearTimeout(pending);
        pending = setTimeout(() => this.render(), 150);
      });
      document.addEventListener("keydown", (ev) => this.key(ev));
    }

    build() {
      const d = this.data;
      const groups = Object.entries(d.axes).map(([axis, values]) =>
        `<div class="tsx-group" role="group" aria-label="${esc(NAMES[axis] || axis)}">` +
        `<span class="tsx-name">${esc(NAMES[axis] || axis)}</span>` +
        values.map((v) => `<button type="button" data-axis="${axis}" data-value='${esc(JSON.stringify(v))}'>` +
          `${esc(valueText(axis, v))}</button>`).join("") + "</div>").join("");
      const compare = `<div class="tsx-group" role="group" aria-label="Compare">` +
        `<span class="tsx-name">Compare</span><button type="button" data-compare="-1">no</button>` +
        d.comparisons.map((c, i) => `<button type="button" data-compare="${i}">${esc(c.name)}</button>`).join("") +
        "</div>";
      const legend = d.ops.map((op) => `<span><i class="tsx-sw tsx-op-${op}"></i>${op}</span>`).join("") +
        Object.entries(STATES).map(([k, v]) =>
          `<span><i class="tsx-sw tsx-st" data-state="${esc(k)}">${esc(k)}</i>${v}</span>`).join("") +
        `<span><i class="tsx-sw tsx-mem-u"></i>unsharded bytes</span>` +
        `<span><i class="tsx-sw tsx-mem-g"></i>gradient buffers</span>`;
      this.root.innerHTML =
        `<div class="tsx-controls">${groups}${compare}</div>` +
        `<div class="tsx-stepper"><button type="button" data-step="-1" aria-label="previous event">&#9664; prev</button>` +
        `<input type="range" min="0" max="0" value="0" aria-label="event">` +
        `<button type="button" data-step="1" aria-label="next event">next &#9654;</button>` +
        `<span class="tsx-where" aria-live="polite"></span></div>` +
        `<div class="tsx-legend">${legend}</div>` +
        `<div class="tsx-panels"></div><div class="tsx-totals"></div>`;
      this.root.querySelector(".tsx-controls").addEventListener("click", (ev) => {
        const b = ev.target.closest("button");
        if (!b || b.disabled) return;
        if (b.dataset.axis) this.choice[b.dataset.axis] = JSON.parse(b.dataset.value);
        else this.compare = b.dataset.compare === "-1" ? null : d.comparisons[+b.dataset.compare];
        this.render();
        this.remember();
      });
      this.root.querySelector(".tsx-stepper").addEventListener("click", (ev) => {
        const b = ev.target.closest("button[data-step]");
        if (b) this.move(this.cursor + +b.dataset.step, true);
      });
      this.slider = this.root.querySelector("input[type=range]");
      this.slider.addEventListener("input", () => this.move(+this.slider.value, true));
      this.root.querySelector(".tsx-panels").addEventListener("click", (ev) => {
        const col = ev.target.closest("[data-col]");
        if (col) this.move(+col.dataset.col, true);
      });
    }

    /* The address remembers the choice (#setting=impl|world|reshard|prefetch|dtype&compare=k
       &event=i), so that a view can be linked to; a heading's anchor is left alone. */
    restore() {
      const m = /^#setting=([^&]*)&compare=(-?\d+)&event=(\d+)$/.exec(decodeURIComponent(location.hash));
      if (!m) return;
      const values = m[1].split("|");
      Object.entries(this.data.axes).forEach(([axis, options], i) => {
        const v = options.find((o) => String(o).toLowerCase() === values[i]);
        if (v !== undefined) this.choice[axis] = v;
      });
      this.compare = this.data.comparisons[+m[2]] || null;
      this.cursor = +m[3];
    }

    remember() {
      const c = this.compare ? this.data.comparisons.indexOf(this.compare) : -1;
      const hash = `#setting=${keyOf(this.data.axes, this.choice)}&compare=${c}&event=${this.cursor}`;
      history.replaceState(null, "", hash);
    }

    /* The settings shown: one, or the two of the comparison. */
    shown() {
      if (!this.compare) return [{title: "this setting", choice: this.choice}];
      const {axis, a, b} = this.compare;
      return [a, b].map((v) => ({title: valueText(axis, v), choice: {...this.choice, [axis]: v}}));
    }

    render() {
      const d = this.data;
      for (const b of this.root.querySelectorAll(".tsx-controls button")) {
        const axis = b.dataset.axis;
        const on = axis ? JSON.stringify(this.choice[axis]) === b.dataset.value
          : (this.compare ? d.comparisons.indexOf(this.compare) : -1) === +b.dataset.compare;
        const compared = axis && this.compare && this.compare.axis === axis;
        b.setAttribute("aria-pressed", on && !compared ? "true" : "false");
        b.disabled = !!compared;
        b.classList.toggle("tsx-compared", !!compared);
      }
      this.views = this.shown().map((v) => ({...v, s: d.schedules[keyOf(d.axes, v.choice)]}));
      const missing = this.views.find((v) => !v.s);
      const panels = this.root.querySelector(".tsx-panels");
      if (missing) {
        panels.innerHTML = `<p class="tsx-error">No recording of ${esc(keyOf(d.axes, missing.choice))}.</p>`;
        return;
      }
      const scale = Math.max(...this.views.map((v) => v.s.peaks.with_grads.bytes), 1);
      const scaleText = this.views.reduce((a, v) => (v.s.peaks.with_grads.bytes >= a.b ?
        {b: v.s.peaks.with_grads.bytes, t: v.s.peaks.with_grads.size} : a), {b: -1, t: ""}).t;
      const width = Math.max(panels.clientWidth - 2, 300);
      const scroll = [...panels.querySelectorAll(".tsx-scroll")].map((f) => f.scrollLeft);
      panels.innerHTML = this.views.map((v, i) =>
        `<section class="tsx-panel">` +
        (this.compare ? `<h3 class="tsx-title">${esc(v.title)}</h3>` : "") +
        `<p class="tsx-label">${esc(v.s.label)}; rank ${v.s.rank} of ${v.s.world} as recorded. ` +
        `<code>${command(v.s.command)}</code> prints it as a table.</p>` +
        `<div class="tsx-figure">${this.figure(v.s, scale, scaleText, width)}</div>` +
        `<div class="tsx-event"></div></section>`).join("");
      panels.querySelectorAll(".tsx-scroll").forEach((f, i) => { f.scrollLeft = scroll[i] || 0; });
      this.root.querySelector(".tsx-totals").innerHTML = this.totals();
      this.length = Math.max(...this.views.map((v) => v.s.events.length));
      this.slider.max = String(this.length - 1);
      this.move(this.cursor);
    }

    /* The figure: a label column that stays put, and the timeline beside it, which scrolls
       when it is wider than the page (one column per event, at least MIN_COL wide). */
    figure(s, scale, scaleText, width) {
      const n = s.events.length, rows = s.groups.slice();
      if (s.collectives.some((c) => c.group === null)) rows.push("(no group)");
      const col = Math.max(MIN_COL, Math.floor((width - LABEL_W - 4) / Math.max(n, 1)));
      const W = n * col + 4, memY = HEAD_H + rows.length * ROW_H + 10;
      const H = memY + MEM_H + 30, x = (i) => 2 + i * col, base = memY + MEM_H;
      const ops = this.data.ops.filter((op) => s.collectives.some((c) => c.op === op));
      const lane = Math.max(4, Math.floor(12 / Math.max(ops.length, 1)));
      const label = (y, text, dim) =>
        `<text class="tsx-t${dim ? " tsx-dim" : ""}" x="${LABEL_W - 6}" y="${y}" text-anchor="end">${esc(text)}</text>`;
      const labels = [label(30, "event", true), label(43, "hook", true),
        ...rows.map((g, j) => label(HEAD_H + j * ROW_H + 13, g)),
        label(memY + 12, "memory"), label(memY + 26, scaleText, true)];
      const out = [];
      const phases = [];  // [phase, first event, last event]
      s.events.forEach((e, i) => {
        const last = phases[phases.length - 1];
        if (last && last[0] === e.phase) last[2] = i; else phases.push([e.phase, i, i]);
      });
      for (const [phase, a, b] of phases) {
        out.push(`<rect class="tsx-phase-${phase}" x="${x(a) + 1}" y="2" width="${(b - a + 1) * col - 2}" height="14" rx="3"/>`,
          `<text class="tsx-t" x="${x(a) + 4}" y="13">${esc(phase)}</text>`);
      }
      s.events.forEach((e, i) => {
        out.push(`<text class="tsx-t" x="${x(i) + col / 2}" y="30" text-anchor="middle">${i}</text>`,
          `<text class="tsx-t tsx-dim" x="${x(i) + col / 2}" y="43" text-anchor="middle">${HOOK_SHORT[e.hook] || e.hook}</text>`);
        s.groups.forEach((g, j) => {
          const st = e.states[j], y = HEAD_H + j * ROW_H;
          out.push(`<rect class="tsx-cell${e.group === g ? " tsx-here" : ""}" data-state="${esc(st)}" x="${x(i) + 1}" ` +
            `y="${y}" width="${col - 2}" height="17" rx="2"/>`,
            `<text class="tsx-t tsx-cell-t" data-state="${esc(st)}" x="${x(i) + col / 2}" y="${y + 13}" text-anchor="middle">${esc(st)}</text>`);
        });
      });
      /* Collectives: in the row of the group they carry, one sub-lane per op, from the event
         that issued them to the one that first read their result (async), or in their own. */
      const seen = new Set();
      for (const c of s.collectives) {
        const j = c.group === null ? rows.length - 1 : s.groups.indexOf(c.group);
        const from = c.event === null ? n - 1 : c.event;
        const to = c.blocking || c.used_in === null ? from : Math.min(Math.max(c.used_in, from), n - 1);
        const k = `${j}|${c.op}|${from}|${to}|${c.blocking}`;
        if (seen.has(k) || j < 0) continue;
        seen.add(k);
        const y = HEAD_H + j * ROW_H + 19 + ops.indexOf(c.op) * lane;
        out.push(`<rect class="tsx-op-${c.op}" x="${x(from) + 3}" y="${y}" width="${col - 6}" height="${lane}"/>`);
        if (to > from) {
          out.push(`<rect class="tsx-op-${c.op} tsx-flight" x="${x(from) + col - 3}" y="${y}" ` +
            `width="${(to - from) * col}" height="${lane}"/>`);
        }
      }
      /* The memory lane: unsharded parameters and gradient buffers after each event, on one
         scale for every schedule shown; the peaks marked. */
      const h = (b) => (b / scale) * MEM_H;
      out.push(`<line class="tsx-axis" x1="0" x2="${W}" y1="${base}" y2="${base}"/>`,
        `<line class="tsx-axis tsx-top" x1="0" x2="${W}" y1="${memY}" y2="${memY}"/>`);
      const pu = s.peaks.unsharded.event, pg = s.peaks.with_grads.event;
      s.events.forEach((e, i) => {
        const hu = h(e.unsharded), hg = h(e.grads), bx = x(i) + 5, bw = col - 10;
        out.push(`<rect class="tsx-mem-u${i === pu ? " tsx-peak" : ""}" x="${bx}" y="${base - hu}" width="${bw}" height="${hu}"/>`,
          `<rect class="tsx-mem-g" x="${bx}" y="${base - hu - hg}" width="${bw}" height="${hg}"/>`);
      });
      const mark = (i, cls, text) => i === null ? "" :
        `<text class="tsx-t ${cls}" x="${x(i) + col / 2}" y="${base + 14}" text-anchor="middle">${text}</text>`;
      out.push(mark(pu, "tsx-peak-t", "peak"), pg !== pu ? mark(pg, "tsx-peakg-t", "+grads") : "");
      out.push(`<rect class="tsx-cursor" x="${x(0)}" y="0" width="${col}" height="${H - 10}" rx="3"/>`);
      s.events.forEach((e, i) => out.push(`<rect class="tsx-hit" data-col="${i}" x="${x(i)}" y="0" width="${col}" ` +
        `height="${H}"><title>#${i} ${e.hook} ${esc(e.group)}</title></rect>`));
      return `<svg class="tsx-svg tsx-labels" width="${LABEL_W}" height="${H}" aria-hidden="true">${labels.join("")}</svg>` +
        `<div class="tsx-scroll"><svg class="tsx-svg" width="${W}" height="${H}" role="img" ` +
        `aria-label="timeline of ${esc(s.label)}">${out.join("")}</svg></div>`;
    }

    totals() {
      const views = this.views, ops = this.data.ops.filter((op) =>
        views.some((v) => v.s.totals.by_op.some((t) => t.op === op)));
      const peak = (p) => p.event === null ? "-" :
        `<b>${esc(p.size)}</b> at #${p.event} (${esc(p.hook)} ${esc(p.group)}); unsharded: ` +
        `${esc(p.unsharded.join(", ") || "none")}` +
        (p.gathering.length ? `; being gathered: ${esc(p.gathering.join(", "))}` : "");
      const row = (name, cell) => `<tr><th scope="row">${name}</th>` +
        views.map((v) => `<td data-label="${esc(v.title)}">${cell(v.s)}</td>`).join("") + "</tr>";
      const byOp = (s, op) => {
        const t = s.totals.by_op.find((r) => r.op === op);
        return t ? `${t.count} &middot; ${esc(t.size)}` : "none";
      };
      return `<h3>Totals of the step</h3><table class="tsx-sum"><thead><tr><th></th>` +
        views.map((v) => `<th scope="col">${esc(v.title)}</th>`).join("") + "</tr></thead><tbody>" +
        ops.map((op) => row(`<i class="tsx-sw tsx-op-${op}"></i>${op}`, (s) => byOp(s, op))).join("") +
        row("collectives in all", (s) => `${s.totals.count} &middot; ${esc(s.totals.size)}`) +
        row("peak unsharded", (s) => peak(s.peaks.unsharded)) +
        row("peak with gradient buffers", (s) => peak(s.peaks.with_grads)) +
        "</tbody></table>";
    }

    move(i, byUser) {
      this.cursor = Math.max(0, Math.min(i, this.length - 1));
      if (byUser) this.remember();
      this.slider.value = String(this.cursor);
      this.root.querySelector(".tsx-where").textContent = `event ${this.cursor} of ${this.length - 1}`;
      const panels = this.root.querySelectorAll(".tsx-panel");
      this.views.forEach((v, k) => {
        const panel = panels[k], figure = panel.querySelector(".tsx-scroll");
        const cursor = panel.querySelector(".tsx-cursor"), hit = panel.querySelector(`[data-col="${this.cursor}"]`);
        cursor.style.display = hit ? "" : "none";
        if (hit) {
          const cx = +hit.getAttribute("x"), cw = +hit.getAttribute("width");
          cursor.setAttribute("x", cx);
          if (cx < figure.scrollLeft || cx + cw > figure.scrollLeft + figure.clientWidth) {
            figure.scrollLeft = Math.max(0, cx - figure.clientWidth / 2);
          }
        }
        panel.querySelector(".tsx-event").innerHTML = this.event(v.s, this.cursor);
      });
    }

    event(s, i) {
      const e = s.events[i];
      if (!e) return `<p class="tsx-dim">This step has no event #${i}.</p>`;
      const chips = s.groups.map((g, j) =>
        `<span class="tsx-chip${g === e.group ? " tsx-here" : ""}" data-state="${esc(e.states[j])}" ` +
        `title="${esc(STATES[e.states[j]] || e.states[j])}">${esc(g)} <b>${esc(e.states[j])}</b></span>`).join("");
      const marks = (i === s.peaks.unsharded.event ? ' <span class="tsx-badge tsx-peak-t">peak unsharded</span>' : "") +
        (i === s.peaks.with_grads.event ? ' <span class="tsx-badge tsx-peakg-t">peak with gradients</span>' : "");
      const calls = e.collectives.map((k) => s.collectives[k]);
      const table = calls.length ? `<table class="tsx-calls"><thead><tr><th>op</th><th>dtype</th><th>bytes</th>` +
        `<th>ranks</th><th>when</th><th>carries</th></tr></thead><tbody>` +
        calls.map((c) => `<tr><td data-label="op"><i class="tsx-sw tsx-op-${c.op}"></i>${c.op}</td>` +
          `<td data-label="dtype">${esc(c.dtype)}</td><td data-label="bytes">${esc(c.size)}</td>` +
          `<td data-label="ranks">${c.ranks}</td><td data-label="when">${esc(when(s, c))}</td>` +
          `<td data-label="carries">${esc(c.carries)}</td></tr>`).join("") + "</tbody></table>"
        : `<p class="tsx-dim">No collective was issued during this hook.</p>`;
      return `<p class="tsx-head"><span class="tsx-idx">#${i}</span> <b>${esc(e.hook)}</b> of <b>${esc(e.group)}</b>` +
        ` <span class="tsx-dim">(${esc(e.phase)})</span></p><p class="tsx-chips">${chips}</p>` +
        `<p class="tsx-memline">unsharded parameters <b>${esc(e.unsharded_size)}</b> &middot; gradient buffers ` +
        `<b>${esc(e.grads_size)}</b>${marks}</p><p class="tsx-sub">Collectives issued during this hook: ${calls.length}</p>${table}`;
    }

    key(ev) {
      const t = ev.target;
      if (ev.altKey || ev.ctrlKey || ev.metaKey || (t && t.closest && t.closest("input, select, textarea"))) return;
      const step = {ArrowLeft: -1, ArrowRight: 1}[ev.key];
      if (step) this.move(this.cursor + step, true);
      else if (ev.key === "Home") this.move(0, true);
      else if (ev.key === "End") this.move(this.length - 1, true);
      else return;
      ev.preventDefault();
    }
  }

  function start(root) {
    const src = root.dataset.src;
    if (!src) return;
    root.innerHTML = '<p class="tsx-dim">Loading the recorded schedules&hellip;</p>';
    fetch(src)
      .then((r) => { if (!r.ok) throw new Error(`${r.status} ${r.statusText}`); return r.json(); })
      .then((data) => { root.explorer = new Explorer(root, data); })
      .catch((err) => {
        root.innerHTML = `<p class="tsx-error">Could not load the schedules (${esc(src)}): ${esc(err.message)}. ` +
          "A browser may refuse to read them from a file:// page; open the site through a web server " +
          "(<code>mkdocs serve</code>, or <code>python -m http.server</code> in the built site).</p>";
      });
  }

  const all = () => document.querySelectorAll(".ts-explorer").forEach(start);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
})();
