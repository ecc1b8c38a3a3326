/**
 * Pure formatting: the words and numbers people read. Kept free of DOM and
 * JupyterLab imports so every view says things the same way.
 */
import { IGpuFracEvent, IGpuRef } from './api';
import { restoreFactsOf, restoreSummary } from './view';

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

/** "3.2 GiB", "512 MiB"; GPU memory is counted in binary units everywhere. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !isFinite(bytes)) {
    return '–';
  }
  if (Math.abs(bytes) >= GiB) {
    const v = bytes / GiB;
    return `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} GiB`;
  }
  return `${Math.round(bytes / MiB)} MiB`;
}

/**
 * "2.1/4.0 GiB", "300/512 MiB": usage against request in one unit, the one
 * that suits the larger of the two, so the pair reads at a glance
 * (jupyter-resource-usage's "Mem: 200 MB"). "–" for a figure not sampled,
 * "<0.1" for one too small to show in that unit.
 */
export function usageOfRequest(
  usage: number | null | undefined,
  request: number | null | undefined
): string {
  const known = (x: number | null | undefined): x is number =>
    x !== null && x !== undefined && isFinite(x);
  const scale = Math.max(
    known(usage) ? Math.abs(usage) : 0,
    known(request) ? Math.abs(request) : 0
  );
  const inGiB = scale >= GiB;
  const figure = (x: number | null | undefined): string => {
    if (!known(x)) {
      return '–';
    }
    const v = x / (inGiB ? GiB : MiB);
    const text = !inGiB || v >= 100 ? v.toFixed(0) : v.toFixed(1);
    // A CUDA context alone is 50 MiB: "0.0" would read as nothing used.
    if (v > 0 && Number(text) === 0) {
      return inGiB ? '<0.1' : '<1';
    }
    return text;
  };
  const unit = inGiB ? 'GiB' : 'MiB';
  return known(request)
    ? `${figure(usage)}/${figure(request)} ${unit}`
    : `${figure(usage)} ${unit}`;
}

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
export function gpuLabel(gpu: IGpuRef): string {
  const parts = [`GPU ${gpu.index}`];
  const short = shortGpuName(gpu);
  if (short) {
    parts.push(short);
  }
  if (gpu.simulated) {
    parts.push('simulated');
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

/** "2 of 3 variables restored; lost: gen — re-run …; cell [7] … was cut off: re-run it" */
export function restoredSummary(event: IGpuFracEvent): string {
  return restoreSummary(restoreFactsOf(event));
}

/**
 * One sentence for people. The server writes `message` for exactly this; the
 * fallback only matters for events from an older server.
 */
export function describeEvent(event: IGpuFracEvent): string {
  if (event.message) {
    return event.message;
  }
  const why = event.reason ? ` (${event.reason})` : '';
  switch (event.event) {
    case 'placed':
      return `Placed on GPU ${event.gpu_index ?? '?'}.`;
    case 'bursting':
      return `Bursting above its guaranteed ${formatBytes(event.request)}.`;
    case 'shrink_requested':
      return `Asked to shrink to its guaranteed ${formatBytes(event.request)}${why}.`;
    case 'migrating':
      return `Moving from GPU ${event.from_gpu_index ?? '?'} to GPU ${event.to_gpu_index ?? '?'}${why}.`;
    case 'migrated':
      return `Moved from GPU ${event.from_gpu_index ?? '?'} to GPU ${event.to_gpu_index ?? '?'}${why}.`;
    case 'oom_killed':
      return `Killed to free GPU memory${why}; it restarts from its last checkpoint.`;
    case 'restored':
      return `Restored: ${restoredSummary(event)}.`;
    case 'no_gpu':
      return `Running without a GPU${why}.`;
    case 'move_pending':
      return `Moving to another GPU once the running cell ends, at most at ${formatTime(event.deadline)}${why}.`;
    case 'agent_unreachable':
      return "The GPU agent does not answer; this kernel's GPU share cannot be verified.";
    case 'agent_reachable':
      return 'The GPU agent answers again; GPU shares are verified again.';
    default:
      return event.event;
  }
}

/** A stable key so the same event heard twice (stream and poll) counts once. */
export function eventKey(event: IGpuFracEvent): string {
  return `${event.kernel_id}|${event.event}|${event.time ?? ''}`;
}
