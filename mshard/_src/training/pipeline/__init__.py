"""Pipeline parallel: stage cutting, balance, schedules, the SPMD pipeline program, parameter storage, reports and
the ``PipelineCell`` / ``Pipeline`` Cells."""
