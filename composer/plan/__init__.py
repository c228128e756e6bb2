"""``composer plan``: per-rank memory, communication and step-time bounds for a layout at any
scale, from the same construction path as training (docs/planning.md).

``ranks``: the exact part (an impersonated rank's shards on meta); ``comm`` (with
``comm_parts``): each collective of a training step, by kind and group; ``estimate``: the
modelled part (activations, step time); ``hardware``: the GPU table; ``report``: one plan;
``search``: the best layouts that fit, ranked on ``analytic``'s estimate of the exact bytes
(the placements read from the blocks' plans, no construction).
"""
