"""A plan as something people read: tables, baselines, explanations, SVG pictures (the op graph, the chart against the baselines).

Everything here is a pure function over `Plan` objects (and, for the pictures
and explanations, the op graph the plan was made from); nothing here changes
a plan.
"""
