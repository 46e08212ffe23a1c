"""Tools that read the JSON-lines traces of pyllama processes: `merge` puts the files of one run
on a common time line (Chrome trace, per-step summary); `device_idle` tells when each device
waited, and whether anything else was working meanwhile."""
