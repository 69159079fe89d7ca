"""Running one command on several ranks started by ``mlx.launch``: the group
and its mode (``group.py``), a timeout on collectives (``watchdog.py``) and
host values every rank must agree on (``broadcast.py``). The model's side
(tensor and pipeline sharding) is ``models/sharding.py``."""
