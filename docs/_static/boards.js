// Leaderboard pages: every table becomes sortable by any column and filterable by method, with the
// vendored Grid.js (docs/_static/vendor/gridjs, MIT). A page opts in with a `fedskew-board` block.
(function () {
  "use strict";
  function text(html) {
    const div = document.createElement("div");
    div.innerHTML = html;
    return (div.textContent || "").trim();
  }
  // the leading number of a cell ("72.07 +- 0.60 (#1)", "**3.00**", "7/0/0"), else its text
  function key(html) {
    const t = text(html);
    const m = t.match(/^-?\d+(\.\d+)?/);
    return m ? parseFloat(m[0]) : t.toLowerCase();
  }
  function compare(a, b) {
    const x = key(a), y = key(b);
    if (typeof x === typeof y) return x < y ? -1 : x > y ? 1 : 0;
    return typeof x === "number" ? -1 : 1; // numbers before words ("none", "not run")
  }
  function enhance(table, index) {
    const heads = Array.from(table.querySelectorAll("thead th")).map((th) => th.textContent.trim());
    const rows = Array.from(table.querySelectorAll("tbody tr")).map((tr) =>
      Array.from(tr.children).map((td) => td.innerHTML.trim()));
    if (!heads.length || !rows.length) return;
    const holder = document.createElement("div");
    holder.className = "fedskew-grid";
    holder.id = "board-table-" + index;
    table.parentNode.insertBefore(holder, table);
    new gridjs.Grid({
      columns: heads.map((name) => ({ name: name, sort: { compare: compare },
                                      formatter: (cell) => gridjs.html(cell) })),
      data: rows,
      sort: true,
      search: { selector: (cell, rowIndex, cellIndex) => (cellIndex === 0 ? text(cell) : "") },
      language: { search: { placeholder: "Filter by method..." } },
    }).render(holder);
    table.classList.add("fedskew-replaced");
    table.style.display = "none";
  }
  document.addEventListener("DOMContentLoaded", function () {
    if (!document.querySelector(".fedskew-board")) return;
    document.querySelectorAll("article table.docutils").forEach(enhance);
  });
})();
