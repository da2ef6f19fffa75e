// Every picture of a tutorial (and the pictures the docs hooks draw) opens at full size on a
// click or Enter, and closes on a click, Escape or Enter. No library: the site loads no
// script from elsewhere.
(function () {
  "use strict";

  function open(img) {
    const view = document.createElement("div");
    view.className = "twinshard-zoom";
    view.setAttribute("role", "dialog");
    view.setAttribute("aria-label", "picture at full size");
    view.tabIndex = -1;
    const note = document.createElement("p");
    note.textContent = "Full size: scroll to see all of it; click or press Escape to close.";
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

  function arm() {
    const pictures = document.querySelectorAll(
      ".jupyter-wrapper .jp-RenderedImage img, .md-typeset img.twinshard-figure"
    );
    for (const img of pictures) {
      if (img.dataset.zoom) continue;
      img.dataset.zoom = "1";
      img.tabIndex = 0;
      img.title = "Open at full size";
      img.addEventListener("click", () => open(img));
      img.addEventListener("keydown", (e) => {
        if (e.key === "Enter") open(img);
      });
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", arm);
  } else {
    arm();
  }
})();
