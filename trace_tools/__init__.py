"""Tools that read the JSON-lines traces of pyllama processes: `merge` puts the files of one run
on a common time line (Chrome trace, per-device and per-step summaries); `device_idle` tells when
each device waited, whether anything else was working meanwhile, and which host phase held the
time no device worked; `plot` draws a few steps as a timeline (matplotlib)."""
