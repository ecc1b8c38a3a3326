/**
 * A kernel's history as the panel shows it: one entry per intervention, its
 * steps folded beneath.
 */
import { IGpuFracEvent } from './api';

/** One entry of a kernel's history: an event, and the steps of its story. */
export interface IHistoryEntry {
  /** The newest step: what the entry says. */
  event: IGpuFracEvent;
  /** Every step, oldest first, the newest included. */
  steps: IGpuFracEvent[];
}

/** The steps that continue a story begun by (or continued with) an event. */
const STORY_GOES_ON: Readonly<Record<string, readonly string[]>> = {
  move_pending: ['migrating', 'migrated', 'restored'],
  migrating: ['migrated', 'restored'],
  migrated: ['restored'],
  oom_killed: ['restored'],
  frozen: ['unparked']
};

/**
 * A kernel's events (oldest first) as the history shows them: one entry per
 * intervention, so that a move (its countdown, the move, the restore) reads
 * as one line that says how it ended, its steps folded beneath.
 */
export function historyEntries(events: IGpuFracEvent[]): IHistoryEntry[] {
  const entries: IHistoryEntry[] = [];
  for (const event of events) {
    const last = entries[entries.length - 1];
    if (last && STORY_GOES_ON[last.event.event]?.includes(event.event)) {
      last.steps.push(event);
      last.event = event;
    } else {
      entries.push({ event, steps: [event] });
    }
  }
  return entries;
}
