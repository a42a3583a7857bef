"""The commutativity layer: is each plus really order-free?

:mod:`~span_workflows.commutativity.decorator` (``@commutative`` marks the collections whose
order carries no meaning), :mod:`~span_workflows.commutativity.lint` (checks a query's pluses,
statically and on a backend) and its :mod:`~span_workflows.commutativity.rules`. It reads
queries (:mod:`span_workflows.query`) and nothing above them.
"""
