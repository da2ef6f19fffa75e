/* The schedule explorer's drawings (docs/explorer.md): from one recorded schedule of
   explorer/schedules.json, the timeline (inline SVG), an event's details and the totals, as
   markup. Every number comes from the file (docs/hooks/explorer_page.py computes them); this
   only lays them out. docs/js/explorer.js owns the controls and the cursor and calls these
   through window.twinshardExplorerDraw. */
(function () {
  "use strict";

  const HOOK_SHORT = {pre_forward: "pre", post_forward: "post", pre_backward: "pre",
                      post_backward: "post", final_callback: "end"};
  // What each state letter means; the legend shows those that occur (data.states).
  const STATES = {U: "unsharded", G: "being gathered (its buffer counted in memory)",
                  P: "post-forward piece", S: "sharded", "-": "freed", "*": "mixed"};
  const LABEL_W = 78, MIN_COL = 34, ROW_H = 33, MEM_H = 72, HEAD_H = 48;

  const esc = (s) => String(s).replace(/[&<>"']/g, (c) =>
    ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

  /* A command line that wraps between its flags, never inside one. */
  const command = (text) => text.split(" --").map((w, i) =>
    `<span class="tsx-nowrap">${esc(i ? "--" + w : w)}</span>`).join(" ");

  function when(s, c) {
    if (c.blocking) return "blocking";
    if (c.used_in === null) return "async, not used in this step";
    if (c.used_in >= s.events.length) return "async, used after the step";
    return "async, used in #" + c.used_in;
  }

  function legend(data) {
    return data.ops.map((op) => `<span><i class="tsx-sw tsx-op-${op}"></i>${op}</span>`).join("") +
      data.states.map((k) => `<span><i class="tsx-sw tsx-st" data-state="${esc(k)}">${esc(k)}</i>` +
        `${esc(STATES[k] || k)}</span>`).join("") +
      `<span><i class="tsx-sw tsx-mem-s"></i>this rank's shards</span>` +
      `<span><i class="tsx-sw tsx-mem-u"></i>unsharded bytes</span>` +
      `<span><i class="tsx-sw tsx-mem-g"></i>gradient buffers</span>`;
  }

  /* The figure: a label column that stays put, and the timeline beside it, which scrolls
     when it is wider than the page (one column per event, at least MIN_COL wide). */
  function figure(s, allOps, scale, scaleText, width) {
    const n = s.events.length, rows = s.groups.slice();
    if (s.collectives.some((c) => c.group === null)) rows.push("(no group)");
    const col = Math.max(MIN_COL, Math.floor((width - LABEL_W - 4) / Math.max(n, 1)));
    const W = n * col + 4, memY = HEAD_H + rows.length * ROW_H + 10;
    const H = memY + MEM_H + 30, x = (i) => 2 + i * col, base = memY + MEM_H;
    const ops = allOps.filter((op) => s.collectives.some((c) => c.op === op));
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
    /* The memory lane: this rank's shards, unsharded parameters and gradient buffers after
       each event, stacked, on one scale for every schedule shown; the peaks marked. */
    const h = (b) => (b / scale) * MEM_H;
    out.push(`<line class="tsx-axis" x1="0" x2="${W}" y1="${base}" y2="${base}"/>`,
      `<line class="tsx-axis tsx-top" x1="0" x2="${W}" y1="${memY}" y2="${memY}"/>`);
    const pu = s.peaks.unsharded.event, pg = s.peaks.with_grads.event;
    s.events.forEach((e, i) => {
      const hs = h(e.sharded), hu = h(e.unsharded), hg = h(e.grads), bx = x(i) + 5, bw = col - 10;
      out.push(`<rect class="tsx-mem-s" x="${bx}" y="${base - hs}" width="${bw}" height="${hs}"/>`,
        `<rect class="tsx-mem-u${i === pu ? " tsx-peak" : ""}" x="${bx}" y="${base - hs - hu}" width="${bw}" height="${hu}"/>`,
        `<rect class="tsx-mem-g" x="${bx}" y="${base - hs - hu - hg}" width="${bw}" height="${hg}"/>`);
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

  /* One event of one schedule: the hook, every group's state, the bytes, its collectives. */
  function details(s, i, title) {
    const e = s.events[i], head = title ? `<h3 class="tsx-title">${esc(title)}</h3>` : "";
    if (!e) return head + `<p class="tsx-dim">This step has no event #${i}.</p>`;
    const chips = s.groups.map((g, j) =>
      `<span class="tsx-chip${g === e.group ? " tsx-here" : ""}" data-state="${esc(e.states[j])}" ` +
      `title="${esc(STATES[e.states[j]] || e.states[j])}">${esc(g)} <b>${esc(e.states[j])}</b></span>`).join("");
    const marks = (i === s.peaks.unsharded.event ? ' <span class="tsx-badge tsx-peak-t">peak unsharded</span>' : "") +
      (i === s.peaks.with_grads.event ? ' <span class="tsx-badge tsx-peakg-t">peak with gradients</span>' : "");
    const calls = e.collectives.map((k) => s.collectives[k]);
    const table = calls.length ? `<table class="tsx-calls"><thead><tr><th>op</th><th>dtype</th><th>bytes</th>` +
      `<th>sent</th><th>ranks</th><th>when</th><th>carries</th></tr></thead><tbody>` +
      calls.map((c) => `<tr><td data-label="op"><i class="tsx-sw tsx-op-${c.op}"></i>${c.op}</td>` +
        `<td data-label="dtype">${esc(c.dtype)}</td><td data-label="bytes">${esc(c.size)}</td>` +
        `<td data-label="sent by this rank">${esc(c.sent_size)}</td>` +
        `<td data-label="ranks">${c.ranks}</td><td data-label="when">${esc(when(s, c))}</td>` +
        `<td data-label="carries">${esc(c.carries)}</td></tr>`).join("") + "</tbody></table>"
      : `<p class="tsx-dim">No collective was issued during this hook.</p>`;
    return head + `<p class="tsx-head"><span class="tsx-idx">#${i}</span> <b>${esc(e.hook)}</b> of <b>${esc(e.group)}</b>` +
      ` <span class="tsx-dim">(${esc(e.phase)})</span></p><p class="tsx-chips">${chips}</p>` +
      `<p class="tsx-memline">this rank's shards <b>${esc(e.sharded_size)}</b> &middot; unsharded parameters ` +
      `<b>${esc(e.unsharded_size)}</b> &middot; gradient buffers <b>${esc(e.grads_size)}</b>${marks}</p>` +
      `<p class="tsx-sub">Collectives issued during this hook: ${calls.length}, ` +
      `<span class="tsx-sent">this rank sent ${esc(e.sent_size)}</span></p>${table}`;
  }

  /* The totals of every schedule shown, one column each. */
  function totals(views, allOps) {
    const ops = allOps.filter((op) => views.some((v) => v.s.totals.by_op.some((t) => t.op === op)));
    const peak = (p) => p.event === null ? "-" :
      `<b>${esc(p.size)}</b> at #${p.event} (${esc(p.hook)} ${esc(p.group)}); unsharded: ` +
      `${esc(p.unsharded.join(", ") || "none")}` +
      (p.gathering.length ? `; being gathered: ${esc(p.gathering.join(", "))}` : "");
    const row = (name, cell, what) => `<tr${what ? ` data-row="${what}"` : ""}><th scope="row">${name}</th>` +
      views.map((v) => `<td data-label="${esc(v.title)}">${cell(v.s)}</td>`).join("") + "</tr>";
    const count = (t) => `${t.count} &middot; ${esc(t.size)} &middot; sent ${esc(t.sent_size)}`;
    const byOp = (s, op) => {
      const t = s.totals.by_op.find((r) => r.op === op);
      return t ? count(t) : "none";
    };
    return `<h3>Totals of the step, on rank 0</h3><p class="tsx-dim">Each collective: how many, ` +
      `their size, and what this rank sent for them on a ring.</p><table class="tsx-sum"><thead><tr><th></th>` +
      views.map((v) => `<th scope="col">${esc(v.title)}</th>`).join("") + "</tr></thead><tbody>" +
      ops.map((op) => row(`<i class="tsx-sw tsx-op-${op}"></i>${op}`, (s) => byOp(s, op))).join("") +
      row("collectives in all", (s) => count(s.totals), "sent") +
      row("this rank's parameter shards", (s) =>
        `<b>${esc(s.param_shards_size)}</b> (1/${s.world} of the parameters, padded)`, "shards") +
      row("peak unsharded", (s) => peak(s.peaks.unsharded)) +
      row("peak with gradient buffers", (s) => peak(s.peaks.with_grads)) +
      "</tbody></table>";
  }

  window.twinshardExplorerDraw = {esc, command, legend, figure, details, totals};
})();
