/**
 * A lease in the panel's words: what keeps its state, its state in the node
 * table, what was asked for, its compute share, and what a restart restores.
 */
import {
  CHECKPOINT_ON_DISK,
  FROZEN_IN_HOST_MEMORY,
  IKernelStatus,
  ILease,
  INodeInfo,
  IRecoveryPoint,
  IShareSource
} from './api';
import { LEASE_STATE_WORDS, SOURCE_WORDS } from './contract';
import { formatBytes } from './memory';
import { defaultTrans, ITrans } from './trans';

// -- what keeps a kernel's state ---------------------------------------------

/**
 * The panel's "Kept by" (`%gpu`'s "kept by", `gpufrac-agent status`'s "KEPT
 * BY"): "frozen in host memory (2.0 GiB of GPU memory)"
 * or "checkpoint on disk", and "(freezing could not be used: …)" when the
 * agent said why it could not freeze the last time it tried. Null without a
 * lease, or from an older server.
 */
export function stateKept(
  status: IKernelStatus | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const protection = status?.protection;
  if (!protection) {
    return null;
  }
  // The server's words; the two it has today are msgids too.
  let text =
    protection === FROZEN_IN_HOST_MEMORY
      ? trans.__('frozen in host memory')
      : protection === CHECKPOINT_ON_DISK
        ? trans.__('checkpoint on disk')
        : protection;
  const bytes = status?.lease?.frozen_bytes;
  if (protection === FROZEN_IN_HOST_MEMORY && bytes) {
    text = trans.__('%1 (%2 of GPU memory)', text, formatBytes(bytes));
  }
  const fallback = (status?.fallback ?? '').trim().replace(/[\s.]+$/, '');
  if (fallback) {
    text = trans.__('%1 (freezing could not be used: %2)', text, fallback);
  }
  return text;
}

/**
 * A lease's state in the node table: the contract's words ("running",
 * "freezing", "thawing", …), and whether it is frozen while it waits.
 */
export function leaseStateWords(
  lease: ILease,
  trans: ITrans = defaultTrans
): string {
  // The contract's words (generated, English) are msgids too.
  const word = LEASE_STATE_WORDS[lease.state];
  const text = word ? trans.__(word) : lease.state;
  if (lease.frozen && lease.state !== 'freezing' && lease.state !== 'thawing') {
    return trans.__('%1, frozen in host memory', text);
  }
  return text;
}

// -- what the server was asked for -------------------------------------------

/**
 * The panel's "Asked for": "request 0.5 (from the kernelspec), limit 1 (from
 * the c.GpuFrac default)", in `%gpu`'s words; without the sources, the specs
 * alone. Null when there is nothing to say.
 */
export function askedFor(
  lease: ILease | null | undefined,
  source: IShareSource | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const requestSpec = lease?.request_spec;
  const limitSpec = lease?.limit_spec ?? lease?.request_spec;
  if (!lease || (!requestSpec && !lease.limit_spec && !source?.request)) {
    return null;
  }
  const part = (spec: string | undefined, from: string | null | undefined) =>
    from
      ? trans.__('%1 (from %2)', spec ?? '–', shareSourceWords(from, trans))
      : (spec ?? '–');
  return trans.__(
    'request %1, limit %2',
    part(requestSpec, source?.request),
    part(limitSpec, source?.limit)
  );
}

/**
 * Where a share came from, in the glossary's words (the contract's, which
 * `%gpu` says too); any other name (a pod annotation) as given.
 */
export function shareSourceWords(
  source: string,
  trans: ITrans = defaultTrans
): string {
  const words = SOURCE_WORDS[source];
  // The contract's words (generated, English) are msgids too.
  return words ? trans.__(words) : source;
}

// -- compute, and what a restart restores ------------------------------------

/**
 * The lease's SM utilization against its compute share, and whether the share
 * holds (only CUDA MPS holds one); null when the lease has neither.
 */
export function computeLine(
  lease: ILease,
  mps: boolean,
  trans: ITrans = defaultTrans
): string | null {
  const used = lease.compute_usage;
  const request = lease.compute_request;
  const usedText =
    used === null || used === undefined
      ? trans.__('not sampled')
      : trans.__("%1% of the GPU's compute", used);
  if (request === null || request === undefined) {
    return used === null || used === undefined ? null : usedText;
  }
  const limit = lease.compute_limit;
  const share =
    limit === null || limit === undefined || limit === request
      ? `${request}`
      : `${request}–${limit}`;
  const held = mps
    ? trans.__('held by CUDA MPS')
    : trans.__('not enforced: no CUDA MPS');
  return trans.__('%1; share %2 of the compute (%3)', usedText, share, held);
}

/**
 * What the node table says of freezing: nothing while the node freezes (or
 * did not say), else that it does not and why — a kernel parked or reclaimed
 * here is then checkpointed and restarted instead.
 */
export function freezingLine(
  freezing: INodeInfo['freezing'],
  trans: ITrans = defaultTrans
): string | null {
  if (!freezing || freezing.available) {
    return null;
  }
  return trans.__(
    'Freezing is off on this node: %1. A kernel parked or reclaimed here is checkpointed and restarted instead.',
    (freezing.why ?? trans.__('the agent did not say why')).replace(/\.$/, '')
  );
}

/** "45 s", "3 min", "2 h 4 min": how long ago, as people read it. */
export function ageWords(
  seconds: number,
  trans: ITrans = defaultTrans
): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return trans.__('%1 s', s);
  }
  if (s < 3600) {
    return trans.__('%1 min', Math.floor(s / 60));
  }
  return trans.__(
    '%1 h %2 min',
    Math.floor(s / 3600),
    Math.floor((s % 3600) / 60)
  );
}

/**
 * "after cell [5], 3 min ago": what a restart restores now. The age is
 * computed from the checkpoint's time when shown (`now`, unix seconds). Null
 * before the first checkpoint, or from an older server.
 */
export function recoveryPointLine(
  point: IRecoveryPoint | null | undefined,
  now: number,
  trans: ITrans = defaultTrans
): string | null {
  if (
    !point ||
    point.durable_time === null ||
    point.durable_time === undefined
  ) {
    return null;
  }
  const age = ageWords(now - point.durable_time, trans);
  return point.durable_cell === null || point.durable_cell === undefined
    ? trans.__('%1 ago', age)
    : trans.__('after cell [%1], %2 ago', point.durable_cell, age);
}

/**
 * "big (4.0 GiB), … — over the per-kernel checkpoint budget …": the variables
 * a restart would not bring back, largest first, and why. Null when every
 * variable is protected.
 */
export function unprotectedLine(
  point: IRecoveryPoint | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const names = Object.entries(point?.unprotected ?? {}).sort(
    ([a, x], [b, y]) => y - x || a.localeCompare(b)
  );
  if (!names.length) {
    return null;
  }
  const shown = names
    .map(([name, bytes]) => trans.__('%1 (%2)', name, formatBytes(bytes)))
    .join(', ');
  const why = (point?.unprotected_why ?? '').trim();
  return why ? trans.__('%1 — %2', shown, why) : shown;
}

/**
 * "after cell [6]: 1.2 GiB of 4.0 GiB": the checkpoint being written, which a
 * restart would restore once it is done. Null when none is, or unknown.
 */
export function writingLine(
  point: IRecoveryPoint | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const writing = point?.writing;
  if (!writing) {
    return null;
  }
  const progress = writing.queued
    ? trans.__('queued, %1', formatBytes(writing.bytes_total))
    : trans.__(
        '%1 of %2',
        formatBytes(writing.bytes_done),
        formatBytes(writing.bytes_total)
      );
  return writing.cell === null || writing.cell === undefined
    ? progress
    : trans.__('after cell [%1]: %2', writing.cell, progress);
}
