/* The memory calculator (docs/memory.md): twinshard plan's device memory per rank, by part.

   The data is memory/plans.json, made at build time by the planner itself
   (docs/hooks/memory_data.py, cached by docs/hooks/memory.py); the page's
   <div class="ts-memory" data-src="..."> says where it is. Every number shown is in that file:
   this script only picks a setting, stacks its parts into bars (one bar per value of the
   "compare" axis, the chosen one outlined) and marks each device's capacity on the same scale.
   Plain JavaScript and HTML, no library: the page must work offline. */
(function () {
  "use strict";

  const NAMES = {model: "Model", seq: "Sequence", batch: "Sequences per rank", world: "Ranks",
                 dtype: "Precision", ac: "Activation checkpointing",
                 reshard: "reshard_after_forward"};
  const VALUES = {model: {"llama3-8b": "Llama 3 8B", "llama3-70b": "Llama 3 70B"},
                  dtype: {bf16: "bf16 mixed", fp32: "fp32"},
                  ac: {none: "none", selective: "selective", block: "every block"}};
  const COLOURS = {sharded: "#3949ab", sharded_grad: "#7986cb", optimizer: "#00897b",
                   params: "#8d6e63", unsharded: "#fb8c00", grad: "#ffcc80",
                   comm: "#8e24aa", fsdp_buffers: "#c2185b", activations: "#90a4ae"};
  const GIB = 2 ** 30;

  const esc = (s) => String(s).replace(/[&<>"']/g, (c) =>
    ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  const valueText = (axis, v) => (VALUES[axis] && VALUES[axis][v]) || String(v);
  const gib = (n) => (n / GIB).toFixed(n < 10 * GIB ? 2 : 1) + " GiB";
  const keyOf = (axes, choice) =>
    Object.keys(axes).map((a) => String(choice[a]).toLowerCase()).join("|");
  /* A command line that wraps between its flags, never inside one. */
  const command = (text) => text.split(" --").map((w, i) =>
    `<span class="tsm-nowrap">${esc(i ? "--" + w : w)}</span>`).join(" ");

  class Calculator {
    constructor(root, data) {
      this.root = root;
      this.data = data;
      this.choice = {};
      for (const [axis, values] of Object.entries(data.axes)) this.choice[axis] = values[0];
      this.compare = data.axes.ac ? "ac" : Object.keys(data.axes)[0];
      this.build();
      this.render();
    }

    build() {
      const axes = this.data.axes;
      const groups = Object.entries(axes).map(([axis, values]) =>
        `<div class="tsm-group" role="group" aria-label="${esc(NAMES[axis] || axis)}">` +
        `<span class="tsm-name">${esc(NAMES[axis] || axis)}</span>` +
        values.map((v) => `<button type="button" data-axis="${esc(axis)}" ` +
          `data-value="${esc(String(v))}">${esc(valueText(axis, v))}</button>`).join("") +
        "</div>").join("");
      const compare = Object.keys(axes).filter((a) => axes[a].length > 1).map((a) =>
        `<option value="${esc(a)}">${esc(NAMES[a] || a)}</option>`).join("");
      this.root.innerHTML =
        `<div class="tsm-controls">${groups}</div>` +
        `<label class="tsm-compare">Bars for each <select>${compare}</select></label>` +
        `<div class="tsm-chart" aria-live="polite"></div>` +
        `<div class="tsm-keys"></div>` +
        `<div class="tsm-detail"></div>`;
      this.root.querySelectorAll("button[data-axis]").forEach((b) => b.addEventListener(
        "click", () => this.pick(b.dataset.axis, b.dataset.value)));
      const select = this.root.querySelector("select");
      select.value = this.compare;
      select.addEventListener("change", () => { this.compare = select.value; this.render(); });
    }

    pick(axis, text) {
      this.choice[axis] = this.data.axes[axis].find((v) => String(v) === text);
      this.render();
    }

    setting(choice) {
      const found = this.data.settings[keyOf(this.data.axes, choice)];
      if (!found) throw new Error("no recorded setting " + keyOf(this.data.axes, choice));
      return found;
    }

    render() {
      this.root.querySelectorAll("button[data-axis]").forEach((b) => b.setAttribute(
        "aria-pressed", String(String(this.choice[b.dataset.axis]) === b.dataset.value)));
      const rows = this.data.axes[this.compare].map((v) => {
        const choice = {...this.choice, [this.compare]: v};
        return {value: v, chosen: String(v) === String(this.choice[this.compare]),
                plan: this.setting(choice)};
      });
      this.renderChart(rows);
      this.renderDetail(this.setting(this.choice));
    }

    /* One stacked bar per row, on a scale that holds the tallest bar and the smallest device. */
    renderChart(rows) {
      const devices = this.data.devices;
      const smallest = Math.min(...devices.map((d) => d.bytes));
      const top = Math.max(smallest, ...rows.map((r) => r.plan.peak_bytes)) * 1.04;
      const at = (bytes) => (100 * bytes / top).toFixed(3) + "%";
      /* a dashed line per capacity within the scale, named above the first bar only */
      const marks = (named) => [...new Set(devices.map((d) => d.bytes))].filter((b) => b <= top)
        .map((b, k) => {
          const names = devices.filter((d) => d.bytes === b).map((d) => d.key).join(", ");
          const name = `<span class="tsm-cap${k % 2}">${Math.round(b / GIB)} GiB</span>`;
          return `<span class="tsm-capacity" style="left:${at(b)}" ` +
            `title="${esc(names)}: ${gib(b)}">${named ? name : ""}</span>`;
        }).join("");
      const bars = rows.map((r, i) => {
        const parts = this.data.parts.filter((p) => r.plan.parts[p.key] > 0).map((p) =>
          `<span class="tsm-part" data-part="${esc(p.key)}" style="width:` +
          `${at(r.plan.parts[p.key])};background:${COLOURS[p.key] || "#999"}" ` +
          `title="${esc(p.name)}: ${gib(r.plan.parts[p.key])}"></span>`).join("");
        const kind = (r.chosen ? " tsm-chosen" : "") + (i === 0 ? " tsm-first" : "");
        return `<div class="tsm-row${kind}">` +
          `<span class="tsm-label">${esc(valueText(this.compare, r.value))}</span>` +
          `<span class="tsm-track">${parts}${marks(i === 0)}</span>` +
          `<span class="tsm-total">${gib(r.plan.peak_bytes)}</span></div>`;
      }).join("");
      this.root.querySelector(".tsm-chart").innerHTML =
        `<div class="tsm-axis">${esc(NAMES[this.compare] || this.compare)}: ` +
        "peak device memory of rank 0, allocated</div>" + bars;
    }

    renderDetail(plan) {
      const d = this.data;
      const total = d.parts.reduce((sum, p) => sum + plan.parts[p.key], 0);
      this.root.querySelector(".tsm-keys").innerHTML = d.parts.map((p) => {
        const bytes = plan.parts[p.key];
        const share = total ? Math.round(100 * bytes / total) : 0;
        return `<span class="tsm-key${bytes ? "" : " tsm-zero"}" data-part="${esc(p.key)}">` +
          `<i style="background:${COLOURS[p.key] || "#999"}"></i>${esc(p.name)} ` +
          `<b>${gib(bytes)}</b>${bytes ? ` (${share}%)` : ""}</span>`;
      }).join("");
      const fits = d.devices.map((dev) => {
        const ok = plan.peak_bytes <= dev.bytes;
        return `<li class="${ok ? "tsm-fits" : "tsm-over"}">${ok ? "fits" : "does not fit"}: ` +
          `${esc(dev.name)} (${gib(dev.bytes)})</li>`;
      }).join("");
      this.root.querySelector(".tsm-detail").innerHTML =
        `<p class="tsm-peak">Peak <b class="tsm-peak-bytes">${gib(plan.peak_bytes)}</b> ` +
        `at <code>${esc(plan.peak_at)}</code>, ${(plan.params / 1e9).toFixed(2)}B ` +
        `parameters in ${plan.blocks} blocks, sharded over ${this.choice.world} ranks; ` +
        (plan.recorded.length > 1
          ? `recorded with ${plan.recorded.join(" and ")} blocks and continued.</p>`
          : "recorded at full depth.</p>") +
        (d.made_by ? `<p class="tsm-made">Recorded from commit <code>${esc(d.made_by.commit)}</code> ` +
          `on ${esc(d.made_by.date)} with torch ${esc(d.made_by.torch)}.</p>` : "") +
        `<ul class="tsm-devices">${fits}</ul>` +
        `<p>The same numbers, and the reserved peak that decides an out-of-memory error:</p>` +
        `<pre class="tsm-command"><code>${command(plan.command)}</code></pre>`;
    }
  }

  function start(root) {
    const src = root.dataset.src;
    if (!src) return;
    root.innerHTML = '<p class="tsm-dim">Loading the planned settings&hellip;</p>';
    fetch(src)
      .then((r) => { if (!r.ok) throw new Error(`${r.status} ${r.statusText}`); return r.json(); })
      .then((data) => { root.calculator = new Calculator(root, data); })
      .catch((err) => {
        root.innerHTML = `<p class="tsm-error">Could not load the plans (${esc(src)}): ` +
          `${esc(err.message)}. A browser may refuse to read them from a file:// page; open ` +
          "the site through a web server (<code>mkdocs serve</code>, or " +
          "<code>python -m http.server</code> in the built site).</p>";
      });
  }

  const all = () => document.querySelectorAll(".ts-memory").forEach(start);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", all);
  else all();
})();
