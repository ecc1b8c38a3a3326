/**
 * The notifications' texts: each names the notebook, says what happened and
 * what was kept, and fits MAX_NOTICE characters without losing the facts.
 */
import { IGpuFracEvent } from './api';
import {
  deferredList,
  deferredNames,
  restoreFactsOf,
  restoreSummary,
  unreported
} from './restore';
import { defaultTrans, ITrans } from './trans';
import {
  cellLabel,
  fitWords,
  nameList,
  notebookName,
  plainText
} from './words';

/** JupyterLab cuts notification messages longer than this (mid-word). */
export const MAX_NOTICE = 140;

/** Whether a `restored` event may be shown as a success: only what the kernel verified. */
export function isVerifiedSuccess(event: IGpuFracEvent): boolean {
  return event.event === 'restored' && event.ok === true;
}

export interface INotice {
  message: string;
  type: 'success' | 'warning';
}

function sentence(text: string): string {
  const t = text.trim();
  if (!t) {
    return '';
  }
  const capital = `${t.charAt(0).toUpperCase()}${t.slice(1)}`;
  return /[.!?…]$/.test(capital) ? capital : `${capital}.`;
}

function withPrefix(prefix: string, text: string): string {
  return prefix ? `${prefix}: ${text}` : text;
}

/**
 * The notification after a restart with restore. A success only when the
 * kernel said everything came back (`ok`); otherwise a warning that names the
 * notebook, what was lost, the cell cut off and what to do. It fits in
 * MAX_NOTICE characters by listing fewer names and less of the cell first,
 * then dropping the cause, and only then cutting at a word ("…"); the
 * "Details" action opens the panel, which has the whole story.
 */
export function restoredNotice(
  event: IGpuFracEvent,
  notebook: string | null,
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): INotice {
  const prefix = notebookName(notebook);
  const facts = restoreFactsOf(event);
  if (event.cause === 'resumed' && event.message) {
    // A notebook reopened after its server went away: the server's short
    // account says from when and where, what came back and what did not.
    return {
      type: isVerifiedSuccess(event) ? 'success' : 'warning',
      message: fitWords(withPrefix(prefix, sentence(event.message)), max)
    };
  }
  const cause = sentence(plainText(event.reason ?? ''));
  if (isVerifiedSuccess(event)) {
    // The cause first, shortened rather than dropped: this text stays in the
    // notification list, read later by someone who was away.
    const facts0 = sentence(restoreSummary(facts, { advice: false }, trans));
    if (!cause) {
      return {
        type: 'success',
        message: fitWords(withPrefix(prefix, facts0), max)
      };
    }
    const room = max - facts0.length - 1 - (prefix ? prefix.length + 2 : 0);
    const why = room >= 24 ? fitWords(cause, room) : '';
    return {
      type: 'success',
      message: fitWords(
        withPrefix(prefix, why ? `${why} ${facts0}` : facts0),
        max
      )
    };
  }
  const lost = facts.lost ?? [];
  const cell = facts.interrupted_cell ?? null;
  if (unreported(facts)) {
    // No report: the server's words, then what to do.
    const body = trans.__(
      'Restarted; what came back is not known: %1',
      restoreSummary(facts, {}, trans)
    );
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  if (!lost.length && !cell && deferredNames(facts).length) {
    // Nothing lost: some variables wait on disk until the GPU has room for them.
    const body = trans.__(
      'Restored; kept on disk for lack of GPU room: %1. Run %gpu restore once there is room',
      deferredList(facts, 2, trans)
    );
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  if (!lost.length && !cell) {
    // ok missing (an older server): the names came back, but nobody said so.
    const body = trans.__(
      'Restored, not verified: %1; run %gpu in the notebook to check',
      restoreSummary(facts, { advice: false }, trans)
    );
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  const advice =
    lost.length && cell
      ? trans.__('Re-run it and the cells that create the lost names.')
      : cell
        ? trans.__('Re-run it.')
        : trans._n(
            'Re-run the cells that create it.',
            'Re-run the cells that create them.',
            lost.length
          );
  const compose = (
    count: boolean,
    maxNames: number,
    cellChars: number,
    withCause: boolean
  ): string => {
    const parts: string[] = [];
    if (count) {
      const total = (facts.restored ?? []).length + lost.length;
      parts.push(
        trans._n(
          '%2 of %1 variable restored',
          '%2 of %1 variables restored',
          total,
          (facts.restored ?? []).length
        )
      );
    }
    if (lost.length) {
      // Names when there is room; only their number as a last resort.
      parts.push(
        maxNames > 0
          ? trans.__('lost: %1', nameList(lost, maxNames, trans))
          : trans._n('lost: %1 variable', 'lost: %1 variables', lost.length)
      );
    }
    if (cell) {
      parts.push(trans.__('cell %1 was cut off', cellLabel(cell, cellChars)));
    }
    const body = `${sentence(parts.join('; '))} ${advice}`;
    return withPrefix(prefix, withCause && cause ? `${body} ${cause}` : body);
  };
  const tiers: Array<[boolean, number, number, boolean]> = [
    [true, Infinity, Infinity, true],
    [true, Infinity, Infinity, false],
    [false, Infinity, Infinity, false],
    [false, 4, 48, false],
    [false, 2, 32, false],
    [false, 1, 20, false],
    [false, 0, 12, false]
  ];
  for (const [count, maxNames, cellChars, withCause] of tiers) {
    const text = compose(count, maxNames, cellChars, withCause);
    if (text.length <= max) {
      return { type: 'warning', message: text };
    }
  }
  return {
    type: 'warning',
    message: fitWords(compose(false, 0, 8, false), max)
  };
}

/**
 * The notification of a move that waits for a running cell, as of
 * `nowSeconds`: "demo.ipynb: Moving to GPU 0 in 28 s, sooner if the running
 * cell ends: to free GPU 1 for a job." The countdown comes first, so a cut
 * only ever shortens the reason; the caller shows it again each second.
 */
export function moveNotice(
  event: IGpuFracEvent,
  notebook: string | null,
  nowSeconds: number = Date.now() / 1000,
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): string {
  const to =
    event.to_gpu_index !== null && event.to_gpu_index !== undefined
      ? trans.__('GPU %1', event.to_gpu_index)
      : trans.__('another GPU');
  const left =
    event.deadline !== undefined
      ? Math.max(0, Math.ceil(event.deadline - nowSeconds))
      : null;
  const head =
    left === null
      ? trans.__('Moving to %1 once the running cell ends', to)
      : left > 0
        ? trans.__(
            'Moving to %1 in %2 s, sooner if the running cell ends',
            to,
            left
          )
        : trans.__('Moving to %1 now; the running cell is cut off', to);
  // What the move is for; from an older server, without the "moved from GPU 1
  // to GPU 0" that the countdown says already (in the future tense).
  const why = plainText(event.reason ?? '')
    .trim()
    .replace(/^moved\s+from\s+\S+(\s+\d+)?\s+to\s+\S+(\s+\d+)?\s*/i, '')
    .replace(/[\s.]+$/, '');
  return fitWords(
    withPrefix(notebookName(notebook), why ? `${head}: ${why}.` : `${head}.`),
    max
  );
}

/** Any other notification: the notebook, then the server's sentence, cut at a word. */
export function eventNotice(
  text: string,
  notebook: string | null,
  max: number = MAX_NOTICE
): string {
  return fitWords(withPrefix(notebookName(notebook), plainText(text)), max);
}

/**
 * The thaw that ends a freeze we notified, in the same notification: back,
 * how long it was frozen, and why (the freeze's cause stays in the
 * notification list, read later by someone who was away).
 */
export function thawedNotice(
  thaw: string,
  frozenReason: string,
  notebook: string | null,
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): string {
  const prefix = notebookName(notebook);
  const back = sentence(plainText(thaw));
  const because = /\bbecause\s+([^:;.]+)/i.exec(plainText(frozenReason));
  if (!because) {
    return fitWords(withPrefix(prefix, back), max);
  }
  const why = trans.__('It was frozen because %1.', because[1].trim());
  // Its asides go first ("; nothing was restarted"), then the cause is cut
  // shorter; it is dropped only where nothing of it would fit.
  const short = `${back.split(/[;,]/)[0].replace(/[.\s]*$/, '')}.`;
  for (const said of [back, short]) {
    const full = withPrefix(prefix, `${said} ${why}`);
    if (full.length <= max) {
      return full;
    }
  }
  const room = max - short.length - 1 - (prefix ? prefix.length + 2 : 0);
  return room >= 24
    ? withPrefix(prefix, `${short} ${fitWords(why, room)}`)
    : fitWords(withPrefix(prefix, back), max);
}

/**
 * The notification of a freeze for someone else's sake, within `max`: the
 * notebook and the server's sentence, its asides "(…)" dropped first where it
 * is too long; when the cut would lose that everything is kept, the cause is
 * cut shorter and the notice says so itself.
 */
export function frozenNotice(
  text: string,
  notebook: string | null,
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): string {
  const prefix = notebookName(notebook);
  const said = plainText(text);
  const full = withPrefix(prefix, said.replace(/\s+/g, ' ').trim());
  if (full.length <= max) {
    return full;
  }
  const bare = withPrefix(
    prefix,
    said
      .replace(/\s*\([^()]*\)/g, '')
      .replace(/\s+/g, ' ')
      .trim()
  );
  const cut = fitWords(bare, max);
  if (/host memory/i.test(cut)) {
    return cut;
  }
  const kept = trans.__(
    'Its process and every variable are kept in host memory.'
  );
  const room = Math.max(max - kept.length - 1, prefix.length + 12);
  return fitWords(`${fitWords(bare, room)} ${kept}`, max);
}
