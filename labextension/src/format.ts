/**
 * Pure formatting: GPU names, times and what an event says. Kept free of DOM
 * and JupyterLab imports so every view says things the same way.
 */
import { FROZEN_IN_HOST_MEMORY, IGpuFracEvent, IGpuRef } from './api';
import { formatBytes } from './memory';
import { restoreFactsOf, restoreSummary } from './restore';
import { defaultTrans, ITrans } from './trans';

/**
 * A short GPU name for the status bar: vendor words go, and a simulated
 * device's "Simulated" prefix goes too because the item says "simulated" on
 * its own.
 */
export function shortGpuName(gpu: IGpuRef): string {
  let name = gpu.name.replace(/\b(NVIDIA|Tesla|GeForce|Quadro)\s+/gi, '');
  if (gpu.simulated) {
    name = name.replace(/\(?\bsimulated\b\)?/gi, '');
  }
  // "GPU 16GiB" after "GPU 1 ·" would say GPU twice.
  name = name.replace(/^\s*GPU\b\s*/i, '');
  return name.replace(/\s+/g, ' ').trim();
}

/** "GPU 1 · 16GiB · simulated" */
export function gpuLabel(gpu: IGpuRef, trans: ITrans = defaultTrans): string {
  const parts = [trans.__('GPU %1', gpu.index)];
  const short = shortGpuName(gpu);
  if (short) {
    parts.push(short);
  }
  if (gpu.simulated) {
    parts.push(trans.__('simulated'));
  }
  return parts.join(' · ');
}

/** "14:02" in the user's locale; the date too when it is not today. */
export function formatTime(unixSeconds: number | undefined): string {
  if (unixSeconds === undefined || !isFinite(unixSeconds)) {
    return '';
  }
  const when = new Date(unixSeconds * 1000);
  const now = new Date();
  const time = when.toLocaleTimeString([], {
    hour: '2-digit',
    minute: '2-digit'
  });
  return when.toDateString() === now.toDateString()
    ? time
    : `${when.toLocaleDateString()} ${time}`;
}

/**
 * "12 s ago", "3 min ago", "2 h ago", or the time of day when older: how long
 * ago `unixSeconds` was, as of `nowSeconds` (when it is shown, never when the
 * event was recorded).
 */
export function formatAge(
  unixSeconds: number,
  nowSeconds: number = Date.now() / 1000,
  trans: ITrans = defaultTrans
): string {
  const seconds = Math.max(0, Math.round(nowSeconds - unixSeconds));
  if (seconds < 60) {
    return trans.__('%1 s ago', seconds);
  }
  if (seconds < 3600) {
    return trans.__('%1 min ago', Math.floor(seconds / 60));
  }
  if (seconds < 6 * 3600) {
    return trans.__('%1 h ago', Math.floor(seconds / 3600));
  }
  return formatTime(unixSeconds);
}

/** "2 of 3 variables restored; lost: gen — re-run …; cell [7] … was cut off: re-run it" */
export function restoredSummary(
  event: IGpuFracEvent,
  trans: ITrans = defaultTrans
): string {
  return restoreSummary(restoreFactsOf(event), {}, trans);
}

/**
 * One sentence for people. The server writes `message` for exactly this; the
 * fallback only matters for events from an older server.
 */
export function describeEvent(
  event: IGpuFracEvent,
  trans: ITrans = defaultTrans
): string {
  if (event.message) {
    return event.message;
  }
  const why = event.reason ? trans.__(' (%1)', event.reason) : '';
  const from = event.from_gpu_index ?? '?';
  const to = event.to_gpu_index ?? '?';
  switch (event.event) {
    case 'placed':
      return trans.__('Placed on GPU %1.', event.gpu_index ?? '?');
    case 'bursting':
      return trans.__(
        'Bursting above its guaranteed %1.',
        formatBytes(event.request)
      );
    case 'shrink_requested':
      return trans.__(
        'Asked to shrink to its guaranteed %1%2.',
        formatBytes(event.request),
        why
      );
    case 'migrating':
      return trans.__('Moving from GPU %1 to GPU %2%3.', from, to, why);
    case 'migrated':
      return trans.__('Moved from GPU %1 to GPU %2%3.', from, to, why);
    case 'oom_killed':
      return trans.__(
        'Killed to free GPU memory%1; it restarts from its last checkpoint.',
        why
      );
    case 'restored':
      return trans.__('Restored: %1.', restoredSummary(event, trans));
    case 'no_gpu':
      return trans.__('Running without a GPU%1.', why);
    case 'move_pending':
      return trans.__(
        'Moving to another GPU once the running cell ends, at most at %1%2.',
        formatTime(event.deadline),
        why
      );
    case 'agent_unreachable':
      return trans.__(
        "The GPU agent does not answer; this kernel's GPU share cannot be verified."
      );
    case 'agent_reachable':
      return trans.__(
        'The GPU agent answers again; GPU shares are verified again.'
      );
    case 'parked':
      if (event.protection === FROZEN_IN_HOST_MEMORY) {
        return trans.__(
          'Parked: frozen in host memory while idle%1, it gave its GPU back; its next cell thaws it, with every variable kept.',
          why
        );
      }
      return trans.__(
        'Parked: gave its GPU back while idle%1; the next cell gets one first.',
        why
      );
    case 'frozen':
      return trans.__(
        'Frozen%1: its process and every variable are kept in host memory (a running cell waits too); it thaws when a GPU has room.',
        why
      );
    case 'unparked':
      return trans.__('Back on GPU %1.', event.gpu_index ?? '?');
    default:
      return event.event;
  }
}

/** JupyterLab's notification types that the agent's interventions use. */
export type NoticeType = 'info' | 'in-progress' | 'warning' | 'error';

/** How an event is notified: its type and when it closes by itself (ms). */
export interface INoticeKind {
  type: NoticeType;
  autoClose: number | false;
}

/**
 * How the agent's interventions are notified; null where the status bar item
 * is enough (placed, bursting, no_gpu, an idle park). A move runs in
 * progress; a shrink warns and goes; a kill is an error that stays. A freeze
 * for someone else's sake (a job, a reclaim) is a warning that stays until
 * read, though the kernel keeps everything; the thaw that ends it is news,
 * not worry. `restored` and the agent's reachability have their own
 * notices (notify.ts).
 */
export function eventNoticeKind(event: IGpuFracEvent): INoticeKind | null {
  switch (event.event) {
    case 'move_pending':
    case 'migrating':
    case 'migrated':
      return { type: 'in-progress', autoClose: false };
    case 'shrink_requested':
      return { type: 'warning', autoClose: 20000 };
    case 'oom_killed':
      return { type: 'error', autoClose: false };
    case 'frozen':
      return { type: 'warning', autoClose: false };
    case 'unparked':
      return { type: 'info', autoClose: 8000 };
    default:
      return null;
  }
}

/** A stable key so the same event heard twice (stream and poll) counts once. */
export function eventKey(event: IGpuFracEvent): string {
  return `${event.kernel_id}|${event.event}|${event.time ?? ''}`;
}
