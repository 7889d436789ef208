"""Methods that change the train step or study its numerics, outside the core.

The core (lambjax.train and the rest of lambjax) imports nothing from here: a config names a
step method by its module (`config.step_method`, lambjax.train.method), and the studies
import what they read.
"""
