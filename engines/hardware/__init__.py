"""Hardware targets: device profiles, deployment scenarios and the analytic cost model.

Shared by `mlx search` (engines/puzzle), which prices block variants for a target, and by
`mlx calibrate` (engines/calibrate), which measures a device and refits its profile.
The layering is scenario → profile → costs; nothing here imports the Puzzle engine.
"""
