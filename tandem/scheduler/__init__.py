from tandem.scheduler.batch import Row, ScheduledBatch
from tandem.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["Row", "ScheduledBatch", "Scheduler", "SchedulerConfig"]
