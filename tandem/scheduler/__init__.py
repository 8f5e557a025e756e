from tandem.scheduler.batch import DecodeColumns, Row, ScheduledBatch
from tandem.scheduler.scheduler import Scheduler, SchedulerConfig, request_slot_count

__all__ = ["DecodeColumns", "Row", "ScheduledBatch", "Scheduler", "SchedulerConfig", "request_slot_count"]
