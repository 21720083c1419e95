"""Measures and drivers: metrics, trace and run files, trace analysis, memory accounting, figures, the app's
compute side (workbench) and the frontier sweep (docs/method.md §4, docs/architecture.md)."""
