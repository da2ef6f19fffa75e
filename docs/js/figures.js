// Every picture of a tutorial (and the pictures the docs hooks draw) opens at full size, and
// says so: a schedule drawn 11 inches wide is shown a third of its size on a phone (its text
// about 4 pixels high), so a picture shown smaller than its own size gets a visible
// "Tap to enlarge" button under it, not only a tooltip. The button, a click on the picture or
// Enter opens the full-size view; a click, Escape or Enter closes it. No library: the site
// loads no script from elsewhere.
(function () {
  "use strict";

  const PICTURES = ".jupyter-wrapper .jp-RenderedImage img, .md-typeset img.twinshard-figure";

  function open(img) {
    const view = document.createElement("div");
    view.className = "twinshard-zoom";
    view.setAttribute("role", "dialog");
    view.setAttribute("aria-label", "picture at full size");
    view.tabIndex = -1;
    const note = document.createElement("p");
    note.textContent = "Full size: scroll to see all of it; tap or press Escape to close.";
    const copy = document.createElement("img");
    copy.src = img.src;
    copy.alt = img.alt || "";
    view.append(note, copy);
    const close = () => {
      view.remove();
      img.focus();
    };
    view.addEventListener("click", close);
    view.addEventListener("keydown", (e) => {
      if (e.key === "Escape" || e.key === "Enter") close();
    });
    document.body.append(view);
    view.focus();
  }

  // The button shows only while the picture is drawn smaller than its own size.
  function update(img, button) {
    const shrunk = img.naturalWidth > 0 && img.clientWidth < 0.95 * img.naturalWidth;
    button.hidden = !shrunk;
  }

  function arm() {
    const buttons = [];
    for (const img of document.querySelectorAll(PICTURES)) {
      if (img.dataset.zoom) continue;
      img.dataset.zoom = "1";
      img.tabIndex = 0;
      img.title = "Open at full size";
      img.addEventListener("click", () => open(img));
      img.addEventListener("keydown", (e) => {
        if (e.key === "Enter") open(img);
      });
      const button = document.createElement("button");
      button.type = "button";
      button.className = "twinshard-enlarge";
      button.textContent = "\u2922 Tap to enlarge";
      button.setAttribute("aria-label", "Open the picture at full size");
      button.addEventListener("click", () => open(img));
      img.after(button);
      buttons.push([img, button]);
      update(img, button);
      img.addEventListener("load", () => update(img, button));
    }
    window.addEventListener("resize", () => buttons.forEach(([i, b]) => update(i, b)));
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", arm);
  } else {
    arm();
  }
})();
