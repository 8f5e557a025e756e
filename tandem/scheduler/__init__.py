from tandem.scheduler.batch import Row, ScheduledBatch
from tandem.scheduler.scheduler import Scheduler, SchedulerConfig, request_slot_count

__all__ = ["Row", "ScheduledBatch", "Scheduler", "SchedulerConfig", "request_slot_count"]
