"""Fine-tuning and downstream evaluation: SQuAD v1.1 / v2.0 and GLUE.

  python -m lambjax.finetune --config=configs/finetune/squad.py[:v2] --workdir=DIR
  python -m lambjax.finetune --config=configs/finetune/glue.py:TASK --workdir=DIR
  python -m lambjax.finetune.squad_eval DATA.json PREDICTIONS.json [--na-prob-file F]

Modules: squad.py and glue.py (reading, features, predictions), squad_metrics.py and
glue_metrics.py (the official metrics), step.py (the heads' losses, pure steps), init.py
(where the encoder starts from), tasks.py (a task as the loop sees it), loop.py (the run).
The heads themselves are in lambjax.models.heads.
"""
