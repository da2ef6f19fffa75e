/* The schedule explorer (docs/explorer.md): recorded training steps, drawn and stepped.

   The data is explorer/schedules.json, made at build time from the real code by
   docs/hooks/explorer_data.py and explorer_page.py (see docs/hooks/explorer.py); the page's
   <div class="ts-explorer" data-src="..."> says where it is. Every number shown comes from
   that file: this script owns the controls and the cursor (one hook event at a time: buttons,
   the slider, the arrow keys, or a click on a column) and docs/js/explorer_draw.js draws. A
   control whose choice would show the very same recording is disabled, and the page says why
   (the file's "alike"). Plain JavaScript, no library: the page must work offline and read the
   same in ten years. */
(function () {
  "use strict";

  const draw = window.twinshardExplorerDraw, esc = draw.esc;
  const NAMES = {impl: "Implementation", world: "Ranks", reshard: "reshard_after_forward",
                 prefetch: "Prefetch", dtype: "Parameters"};
  const VALUES = {prefetch: {1: "one ahead", 2: "two ahead"},
                  dtype: {fp32: "fp32", bf16: "bf16 (fp32 reduce)"}};

  const valueText = (axis, v) => (VALUES[axis] && VALUES[axis][v]) || String(v);
  const valueKey = (v) => String(v).toLowerCase();
  const keyOf = (axes, choice) => Object.keys(axes).map((a) => valueKey(choice[a])).join("|");

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
      /* The stepper sits right above the event's details, so that stepping keeps them in view
         at any width (the figure above may scroll out of it on a small screen). */
      this.root.innerHTML =
        `<div class="tsx-controls">${groups}${compare}</div><ul class="tsx-why"></ul>` +
        `<div class="tsx-legend">${draw.legend(d)}</div><div class="tsx-panels"></div>` +
        `<div class="tsx-step"><div class="tsx-stepper">` +
        `<button type="button" data-step="-1" aria-label="previous event">&#9664; prev</button>` +
        `<input type="range" min="0" max="0" value="0" aria-label="event">` +
        `<button type="button" data-step="1" aria-label="next event">next &#9654;</button>` +
        `<span class="tsx-where" aria-live="polite"></span></div><div class="tsx-events"></div></div>` +
        `<div class="tsx-totals"></div>`;
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
        const v = options.find((o) => valueKey(o) === values[i]);
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
      if (!this.compare) return [{title: "", choice: this.choice}];
      const {axis, a, b} = this.compare;
      return [a, b].map((v) => ({title: valueText(axis, v), choice: {...this.choice, [axis]: v}}));
    }

    schedule(choice) {
      return this.data.schedules[keyOf(this.data.axes, choice)];
    }

    /* Why a control would change nothing that is shown, or "" when it would. */
    deadReason(b) {
      const axis = b.dataset.axis, views = this.views;
      if (axis) {
        if (this.compare && this.compare.axis === axis) return "both of its values are shown: the comparison sets it";
        const v = JSON.parse(b.dataset.value), k = valueKey(v);
        if (views.every((w) => valueKey(w.choice[axis]) === k)) return "";
        const why = views.map((w) => w.s && w.s.alike[axis] && w.s.alike[axis][k]);
        return why.every(Boolean) ? why[0] : "";
      }
      const c = this.data.comparisons[+b.dataset.compare];
      if (!c || c === this.compare) return "";
      const a = this.schedule({...this.choice, [c.axis]: c.a});
      const why = a && a.alike[c.axis] && a.alike[c.axis][valueKey(c.b)];
      return why ? `both sides would be the same recording: ${why}` : "";
    }

    render() {
      const d = this.data;
      this.views = this.shown().map((v) => ({...v, s: this.schedule(v.choice)}));
      const reasons = [];
      for (const b of this.root.querySelectorAll(".tsx-controls button")) {
        const axis = b.dataset.axis;
        const on = axis ? JSON.stringify(this.choice[axis]) === b.dataset.value
          : (this.compare ? d.comparisons.indexOf(this.compare) : -1) === +b.dataset.compare;
        const compared = axis && this.compare && this.compare.axis === axis;
        const why = this.deadReason(b);
        b.setAttribute("aria-pressed", on && !compared ? "true" : "false");
        b.disabled = !!why;
        b.classList.toggle("tsx-compared", !!compared);
        b.title = why ? `Changes nothing here: ${why}` : "";
        if (why) {
          b.setAttribute("aria-description", b.title);
          const group = b.closest(".tsx-group").querySelector(".tsx-name").textContent;
          reasons.push(`<li><b>${esc(group)}: ${esc(b.textContent)}</b> changes nothing here: ${esc(why)}</li>`);
        } else {
          b.removeAttribute("aria-description");
        }
      }
      this.root.querySelector(".tsx-why").innerHTML = reasons.join("");
      const missing = this.views.find((v) => !v.s);
      const panels = this.root.querySelector(".tsx-panels");
      if (missing) {
        panels.innerHTML = `<p class="tsx-error">No recording of ${esc(keyOf(d.axes, missing.choice))}.</p>`;
        return;
      }
      /* One scale for every schedule shown: the most that any of them holds after an event. */
      const top = this.views.reduce((a, v) => (v.s.most_held.bytes > a.bytes ? v.s.most_held : a), {bytes: 0, size: ""});
      const scale = Math.max(top.bytes, 1), scaleText = top.size;
      const width = Math.max(panels.clientWidth - 2, 300);
      const scroll = [...panels.querySelectorAll(".tsx-scroll")].map((f) => f.scrollLeft);
      panels.innerHTML = this.views.map((v) =>
        `<section class="tsx-panel">` +
        (this.compare ? `<h3 class="tsx-title">${esc(v.title)}</h3>` : "") +
        `<p class="tsx-label">${esc(v.s.label)}; rank ${v.s.rank} of ${v.s.world} as recorded. ` +
        `<code>${draw.command(v.s.command)}</code> prints it as a table.</p>` +
        `<div class="tsx-figure">${draw.figure(v.s, d.ops, scale, scaleText, width)}</div></section>`).join("");
      panels.querySelectorAll(".tsx-scroll").forEach((f, i) => { f.scrollLeft = scroll[i] || 0; });
      this.root.querySelector(".tsx-events").innerHTML =
        this.views.map(() => `<section class="tsx-event"></section>`).join("");
      this.root.querySelector(".tsx-totals").innerHTML = draw.totals(this.views, d.ops);
      this.length = Math.max(...this.views.map((v) => v.s.events.length));
      this.slider.max = String(this.length - 1);
      this.move(this.cursor);
    }

    move(i, byUser) {
      this.cursor = Math.max(0, Math.min(i, this.length - 1));
      if (byUser) this.remember();
      this.slider.value = String(this.cursor);
      this.root.querySelector(".tsx-where").textContent = `event ${this.cursor} of ${this.length - 1}`;
      const panels = this.root.querySelectorAll(".tsx-panel");
      const events = this.root.querySelectorAll(".tsx-event");
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
        events[k].innerHTML = draw.details(v.s, this.cursor, v.title);
      });
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
