/**
 * The status bar item's words: its line ("GPU 1: 2.1/4.0 GiB · bursting"),
 * its tooltip and what a screen reader says.
 */
import { IKernelStatus } from './api';
import { formatAge, gpuLabel, shortGpuName } from './format';
import { stateKept } from './lease';
import { formatBytes, usageOfRequest, usageOfShare } from './memory';
import { StatusItemMode } from './settings';
import { holdWords, IStateView } from './stateView';
import { defaultTrans, ITrans } from './trans';
import { capitalize, plainText } from './words';

/**
 * The status bar item's line, "GPU 1: 2.1/4.0 GiB · bursting": it shares the
 * bar with JupyterLab's own items (and jupyter-resource-usage's "Mem: 200 MB"),
 * so it says the numbers and, only when there is news, one short word; the
 * device, the limit and the whole story go to the tooltip and the panel.
 */
export interface IStatusLabel {
  /** "GPU 1" ("GPU 1 (T4)" in full); "GPU" while no GPU is known; '' without a lease ("no GPU" says it). */
  gpu: string;
  /** Usage against request ("2.1/4.0 GiB", "2.1/4.0/8.0 GiB" in full), "?" while the agent cannot verify them, '' when not shown. */
  figures: string;
  /** A short state word; '' while the lease is plainly guaranteed (compact). */
  word: string;
  /** The whole line as read. */
  text: string;
}

/** The status bar's words; the panel and the tooltip keep the long ones. */
function shortWords(trans: ITrans): Record<string, string> {
  return {
    guaranteed: '',
    bursting: trans.__('bursting'),
    shrinking: trans.__('shrinking'),
    migrating: trans.__('moving'),
    'oom-killed': trans.__('stopped'),
    restored: trans.__('restored'),
    'restore-incomplete': trans.__('restored in part'),
    'agent-unreachable': trans.__('agent unreachable'),
    'no-gpu': trans.__('no GPU'),
    parked: trans.__('parked'),
    'waiting-for-gpu': trans.__('waiting for a GPU'),
    unavailable: trans.__('unavailable'),
    unknown: ''
  };
}

/** The status bar's words for a hold: within its 32 characters. */
function holdShortWords(trans: ITrans): Record<string, string> {
  return {
    'parked:frozen': trans.__('parked, frozen'),
    'waiting-for-gpu:frozen': trans.__('frozen, waiting'),
    freezing: trans.__('freezing'),
    thawing: trans.__('thawing')
  };
}

/** How long a thaw stays news in the status bar (s): a freeze of a moment is still seen. */
export const THAW_NEWS_S = 30;

/**
 * "thawed" while the kernel's newest event is a thaw of the last half
 * minute: a freeze as short as a job of a second is otherwise never seen.
 */
function thawNews(
  status: IKernelStatus | null,
  view: IStateView,
  nowSeconds: number,
  trans: ITrans
): string {
  const last = status?.last_event;
  if (
    !last ||
    last.event !== 'unparked' ||
    !/\bthawed\b/.test(last.message) ||
    nowSeconds - last.time > THAW_NEWS_S ||
    !['guaranteed', 'bursting'].includes(view.state)
  ) {
    return '';
  }
  return trans.__('thawed');
}

/** "moving in 23 s" (the countdown is the news), "bursting", or ''. */
export function shortStateWord(
  view: IStateView,
  trans: ITrans = defaultTrans
): string {
  if (view.state === 'move-pending') {
    if (view.secondsLeft === null) {
      return trans.__('moving soon');
    }
    return view.secondsLeft > 0
      ? trans.__('moving in %1 s', view.secondsLeft)
      : trans.__('moving now');
  }
  if (view.shortfall.length) {
    // The most important alone: the tooltip and the panel have the rest.
    return view.shortfall[0];
  }
  return (
    holdWords(holdShortWords(trans), view.state, view.hold) ??
    shortWords(trans)[view.state] ??
    view.label
  );
}

/**
 * Figures only while the agent vouches for them (`verified`); "?" while it
 * does not answer, so a last known figure never passes for a current one; none
 * while a shrink, move or kill is changing them (the tooltip has the last
 * known ones). `full` adds the GPU's name, the limit and always a state word.
 */
export function statusLabel(
  status: IKernelStatus | null,
  view: IStateView,
  mode: StatusItemMode = 'compact',
  trans: ITrans = defaultTrans,
  nowSeconds: number = Date.now() / 1000
): IStatusLabel {
  const full = mode === 'full';
  const device = status?.gpu ?? null;
  // Frozen, it holds no GPU but waits for the one it was frozen on.
  const held = device ?? (view.hold ? (status?.frozen_on ?? null) : null);
  let gpu = '';
  if (held) {
    const name = full ? shortGpuName(held) : '';
    gpu = name
      ? trans.__('GPU %1 (%2)', held.index, name)
      : trans.__('GPU %1', held.index);
  } else if (!['no-gpu', 'parked', 'waiting-for-gpu'].includes(view.state)) {
    gpu = trans.__('GPU');
  }
  let figures = '';
  if (view.state === 'unknown') {
    figures = '…';
  } else if (device && view.verified && view.state !== 'restore-incomplete') {
    // After an incomplete restore what is missing is the news: the word alone.
    figures = full
      ? usageOfShare(status?.usage, status?.request, status?.limit)
      : usageOfRequest(status?.usage, status?.request);
  } else if (device && view.state === 'agent-unreachable') {
    figures = '?';
  }
  let word =
    shortStateWord(view, trans) || thawNews(status, view, nowSeconds, trans);
  if (full && !word && view.state === 'guaranteed') {
    word = view.label;
  }
  if (!held && (view.state === 'parked' || view.hold)) {
    // It holds no GPU, and which it left is not known yet: "GPU parked";
    // never a "GPU ·" with nothing after it.
    word = trans.__('GPU %1', word);
  }
  const head = figures ? `${gpu}: ${figures}` : gpu;
  return {
    gpu,
    figures,
    word,
    text: [head, word].filter(Boolean).join(' · ')
  };
}

/** The tooltip and the screen reader's words for the status bar item. */
export interface IStatusDescription {
  title: string;
  ariaLabel: string;
}

/** "2.1 GiB used of 4.0 GiB guaranteed, 8.0 GiB limit", or the last known figures. */
export function memoryLine(
  status: IKernelStatus | null,
  verified: boolean,
  trans: ITrans = defaultTrans
): string {
  const usage = formatBytes(status?.usage);
  const request = formatBytes(status?.request);
  const limit = formatBytes(status?.limit);
  return verified
    ? trans.__('%1 used of %2 guaranteed, %3 limit', usage, request, limit)
    : trans.__(
        'last seen: %1 used, %2 requested, %3 limit; the agent does not answer, so they may have changed',
        usage,
        request,
        limit
      );
}

/**
 * Everything the item leaves out: the device, usage, request and limit (as
 * last known while unverified), the state in full and why, and what is wrong
 * with the server's settings.
 */
export function statusDescription(
  status: IKernelStatus | null,
  view: IStateView,
  problems: readonly string[] = [],
  trans: ITrans = defaultTrans,
  nowSeconds: number = Date.now() / 1000
): IStatusDescription {
  const gpu = status?.gpu ?? null;
  const device = gpu ? gpuLabel(gpu, trans) : '';
  const memory = gpu ? memoryLine(status, view.verified, trans) : '';
  const reason = view.reason ? ` ${view.reason}` : '';
  // Without a GPU, what keeps its variables is the question.
  const kept =
    view.state === 'parked' || view.state === 'waiting-for-gpu'
      ? stateKept(status, trans)
      : null;
  const lines = [
    device,
    memory && `${capitalize(memory)}.`,
    `${capitalize(view.label)}: ${view.help}${plainText(reason)}`,
    kept && trans.__('Kept by: %1.', kept),
    // Its age as of this rendering, from the event's own time.
    status?.last_event &&
      trans.__(
        'Last news, %1: %2',
        formatAge(status.last_event.time, nowSeconds, trans),
        plainText(status.last_event.message)
      ),
    ...problems.map(problem => trans.__('Server setting problem: %1', problem)),
    trans.__('Click for details.')
  ];
  const summary = [device, memory, view.label].filter(Boolean).join(', ');
  return {
    title: lines.filter(Boolean).join('\n'),
    ariaLabel: trans.__(
      'GPU lease: %1.%2 Press Enter for details.',
      summary,
      plainText(reason)
    )
  };
}
