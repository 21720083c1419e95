"""Measures (layer 2): metrics, trace and run files, trace analysis, memory accounting, figures and the request
limits, independent of any model (docs/method.md §4, docs/architecture.md). The drivers that run them are in
quantwm/drivers/."""
