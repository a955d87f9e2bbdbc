// Tables a reader scans. On a leaderboard page (a `fedskew-board` block): every column sorts (a
// button in its header, whose aria-sort says the order; a cell without a number, such as `none`,
// `not run` or `failed`, sorts last either way), a box filters the rows by method, the method column
// stays at the left while the table scrolls sideways, and a ranked board's `avg rank` and `W/T/L`
// columns come right after it. On any page, a table with a `meaning` or `description` column reads
// as one card a row on a phone (fedskew.css), each cell labelled with its column.
(function () {
  "use strict";
  function number(cell) {
    const m = (cell.textContent || "").trim().replace(/^\*+/, "").match(/^-?\d+(\.\d+)?/);
    return m ? parseFloat(m[0]) : null;
  }
  function heads(table) {
    return Array.from(table.querySelectorAll("thead th")).map((th) => th.textContent.trim());
  }
  // the columns a reader came for, right after the method: avg rank, then W/T/L
  function bringForward(table) {
    const names = heads(table);
    const wanted = names.map((h, i) => (h === "avg rank" || h.startsWith("W/T/L") ? i : -1)).filter((i) => i > 0);
    if (!wanted.length) return;
    table.querySelectorAll("tr").forEach((tr) => {
      const cells = Array.from(tr.children);
      let after = cells[0];
      wanted.forEach((i) => { after.after(cells[i]); after = cells[i]; });
    });
  }
  function sortable(table, index) {
    const body = table.tBodies[0];
    if (!body) return;
    const original = Array.from(body.rows);
    const ths = Array.from(table.querySelectorAll("thead th"));
    ths.forEach((th, col) => {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "fedskew-sort";
      button.textContent = th.textContent.trim();
      button.title = "sort by this column";
      th.textContent = "";
      th.appendChild(button);
      th.setAttribute("aria-sort", "none");
      button.addEventListener("click", () => {
        // the first click puts the highest first (a best-first accuracy or a count), the next the lowest
        const down = th.getAttribute("aria-sort") !== "descending";
        ths.forEach((other) => other.setAttribute("aria-sort", "none"));
        th.setAttribute("aria-sort", down ? "descending" : "ascending");
        const keyed = original.map((tr, i) => ({ tr: tr, i: i, v: number(tr.children[col]),
                                                 t: (tr.children[col].textContent || "").trim().toLowerCase() }));
        const numeric = keyed.some((k) => k.v !== null);
        keyed.sort((a, b) => {
          if (numeric) {
            if ((a.v === null) !== (b.v === null)) return a.v === null ? 1 : -1; // words last, both ways
            if (a.v !== null && a.v !== b.v) return down ? b.v - a.v : a.v - b.v;
          } else if (a.t !== b.t) {
            return (a.t < b.t ? -1 : 1) * (down ? -1 : 1);
          }
          return a.i - b.i;
        });
        keyed.forEach((k) => body.appendChild(k.tr));
      });
    });
    const box = document.createElement("input");
    box.type = "search";
    box.className = "fedskew-filter";
    box.placeholder = "Filter by method...";
    box.setAttribute("aria-label", "filter the rows of table " + (index + 1) + " by method");
    box.addEventListener("input", () => {
      const q = box.value.trim().toLowerCase();
      original.forEach((tr) => {
        tr.hidden = q !== "" && !(tr.children[0].textContent || "").toLowerCase().includes(q);
      });
    });
    const where = table.closest(".table-wrapper") || table;
    where.parentNode.insertBefore(box, where);
    table.classList.add("fedskew-sortable");
  }
  function cards(table) {
    const names = heads(table).map((h) => h.toLowerCase());
    if (!names.includes("meaning") && !names.includes("description")) return;
    table.classList.add("fedskew-cards");
    table.querySelectorAll("tbody tr").forEach((tr) =>
      Array.from(tr.children).forEach((td, i) => td.setAttribute("data-label", heads(table)[i] || "")));
  }
  document.addEventListener("DOMContentLoaded", function () {
    const board = document.querySelector(".fedskew-board");
    document.querySelectorAll("article table.docutils").forEach((table, i) => {
      if (board) {
        bringForward(table);
        sortable(table, i);
      } else {
        cards(table);
      }
    });
  });
})();
