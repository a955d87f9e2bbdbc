"""Experiment tooling: many runs into one table.

- :mod:`fedskew.experiments.sweep`: the sweep file format, planning (methods x option grids x
  partitions x seeds), resumable execution in worker processes, hyper-parameter selection;
- :mod:`fedskew.experiments.store`: the SQLite results store (what runs write, what reports and
  ``fedskew.load_results`` read);
- :mod:`fedskew.experiments.report` and :mod:`fedskew.experiments.plots`: tables in the papers'
  layout and plots, as Markdown and one self-contained HTML page;
- :mod:`fedskew.experiments.presets`: the default comparison and the four papers' reproductions.
"""
